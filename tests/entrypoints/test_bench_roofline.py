"""The benches record which commit they measured."""

import subprocess

from pagedllm.entrypoints import bench_roofline


def test_commit_comes_from_the_environment_when_set(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_COMMIT", "abc1234")
    assert bench_roofline.git_commit() == "abc1234"


def test_commit_marks_a_tree_that_differs_from_head(monkeypatch, tmp_path):
    monkeypatch.delenv("PAGEDLLM_COMMIT", raising=False)
    monkeypatch.chdir(tmp_path)
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "f.txt").write_text("one")
    subprocess.run([*git, "add", "f.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert bench_roofline.git_commit() == head
    (tmp_path / "f.txt").write_text("two")
    assert bench_roofline.git_commit() == f"{head}+dirty"


def test_the_floor_reads_the_kv_cache_in_its_own_element_size():
    shape = dict(num_params=10, embedding_params=2, vocab_size=4, hidden_size=8, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, dtype_bytes=2)
    bf16 = bench_roofline.ModelShape(**shape)
    fp8 = bench_roofline.ModelShape(**shape, kv_dtype_bytes=1)
    assert bf16.kv_bytes_per_token == 2 * fp8.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2
