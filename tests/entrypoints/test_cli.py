"""The `pagedllm` command as a new user meets it: --help explains every flag and its default,
`chat` streams its reply, Ctrl-C exits quietly with 130, a busy port fails before the model loads."""

from __future__ import annotations

import argparse
import io
import os
import socket
import subprocess
import sys
import time

import pytest

from pagedllm.entrypoints import cli


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_help_describes_every_flag_with_its_default(command):
    sub = _subparsers(cli.build_parser())[command]
    text = sub.format_help()
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command}: {action.option_strings or action.dest} has no help"
        if action.option_strings:
            rendered = sub._get_formatter()._expand_help(action) if action.help else ""
            assert "(default" in rendered, f"{command} {action.option_strings[0]}: no default in {rendered!r}"
    assert "--max-num-seqs" in text and "most sequences run in one step" in text


def test_ctrl_c_exits_130_without_a_traceback(monkeypatch, capsys):
    parser = cli.build_parser()

    def interrupted(ns):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    parser.set_defaults(func=interrupted)
    _subparsers(parser)["generate"].set_defaults(func=interrupted)
    assert cli.main(["generate", "hi"]) == 130
    assert "Traceback" not in capsys.readouterr().err


class _Recorder(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def test_chat_streams_the_reply_as_it_is_generated():
    from pagedllm.config import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import RequestOutputKind, SamplingParams

    engine = LLMEngine.from_engine_args(EngineArgs(max_model_len=256, max_num_seqs=2), "LLM_CLASS")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    out = _Recorder()
    reply = cli.stream_reply(engine, [{"role": "user", "content": "Say hello."}], params, out)
    pieces = [w for w in out.writes if w.strip()]
    assert len(pieces) >= 4  # one write per step, not one at the end
    assert out.getvalue() == reply + "\n" and not engine.has_unfinished_requests()


def test_a_busy_port_fails_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--host", "127.0.0.1",
                               "--port", str(port)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "Traceback" not in done.stderr
    assert "model loaded" not in done.stderr + done.stdout, "the model was loaded before the port was checked"
    assert time.monotonic() - t0 < 60


def test_serve_takes_vllms_tool_calling_flags():
    serve = _subparsers(cli.build_parser())["serve"]
    ns = serve.parse_args(["--tool-call-parser", "llama3_json", "--enable-auto-tool-choice"])
    assert ns.tool_call_parser == "llama3_json" and ns.enable_auto_tool_choice
    assert serve.parse_args([]).tool_call_parser is None
    assert not serve.parse_args(["--no-enable-auto-tool-choice"]).enable_auto_tool_choice
    with pytest.raises(SystemExit):
        serve.parse_args(["--tool-call-parser", "nope"])
