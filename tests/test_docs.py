"""The documents: generated files up to date, the README's first commands, links that resolve."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "render_performance.py"
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")

RUN_COMMAND = "bash scripts/install.sh && source .venv/bin/activate && pagedllm serve --port 8000"
TEST_COMMAND = "bash scripts/test.sh"
CURL_EXAMPLE = """curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
  -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0}'"""


def load_script():
    spec = importlib.util.spec_from_file_location("render_performance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def code_blocks(text: str) -> list[str]:
    return [block.strip() for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)]


def test_generated_documents_are_up_to_date():
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_readme_starts_with_the_commands_that_work_on_a_fresh_machine():
    text = (ROOT / "README.md").read_text()
    before_sections = text.split("\n## ", 1)[0]
    assert code_blocks(before_sections) == [RUN_COMMAND, CURL_EXAMPLE, TEST_COMMAND]
    assert "The capital of France is Paris." in before_sections


def test_readme_is_a_few_screens():
    assert len((ROOT / "README.md").read_text().split()) < 1000


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_links_stay_in_the_repository_and_resolve(document: Path):
    text = document.read_text()
    assert "../shared" not in text
    for target in LINK.findall(text):
        assert not re.match(r"[a-z]+:", target), f"{document.name}: link out of the repository: {target}"
        path = target.split("#", 1)[0]
        if not path:
            continue
        resolved = (document.parent / path).resolve()
        assert resolved.is_relative_to(ROOT), f"{document.name}: link out of the repository: {target}"
        assert resolved.exists(), f"{document.name}: broken link: {target}"


def test_current_figures_are_the_latest_runs_at_the_last_commit(tmp_path: Path):
    render = load_script()
    results = {
        "date": "2026-01-01", "device": "NVIDIA H200", "workload": "nano", "commit": "aaaaaaa",
        "seconds": 6.0, "output_tokens_per_s": 20000.0, "fraction_of_floor": 0.6,
        "later": {"date": "2026-01-02", "commit": "bbbbbbb (working tree)",
                  "machine_A": {"seconds": [5.0, 5.2], "output_tokens_per_s": [21000.0, 20500.0]},
                  "machine_B": {"seconds": 4.9, "output_tokens_per_s": 21400.0, "fraction_of_floor": 0.7}},
        "peers": [{"peer": "hf generate", "seconds": 60.0, "output_tokens_per_s": 400.0}],
    }
    latency = {"device": "NVIDIA H200", "model": "benchmarks/configs/qwen3-0.6b", "date": "2026-01-01",
               "commit": "aaaaaaa", "runs": [{"batch_size": 1, "decode_step_ms": 1.0, "floor_step_ms": 0.5}],
               "newer": {"date": "2026-01-02", "commit": "ccccccc", "batch_1": {"decode_step_ms": 0.8}}}
    (tmp_path / "h200-nano-bench-2026-01-01.json").write_text(json.dumps(results))
    (tmp_path / "h200-latency-qwen3-0.6b-2026-01-01.json").write_text(json.dumps(latency))
    (tmp_path / "h200-kernel-sweep-2026-01-01.json").write_text(json.dumps({"what": "a sweep. More."}))

    read = render.read_results(tmp_path)
    assert len(read.nano) == 3 and len(read.latency) == 2 and len(read.peers) == 1
    nano = render.current(read.nano)
    assert [run.commit for run in nano] == ["bbbbbbb", "bbbbbbb"]
    rows = render.current_rows(read)
    assert rows[0][2] == "20,500-21,400 tok/s (4.90-5.20 s)"
    assert rows[1][1:4] == ["Qwen3-0.6B step, batch 1", "0.8 ms", ""]
    assert ("h200-kernel-sweep-2026-01-01.json", "", "2026-01-01", "a sweep") in read.index
