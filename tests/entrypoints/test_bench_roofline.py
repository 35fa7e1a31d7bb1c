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
