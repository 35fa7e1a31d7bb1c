"""The server's LoRA adapters (in process, ASGI): ``--lora-modules`` names in ``/v1/models`` with
the base model as parent, a request picks one by ``model`` (its text is transformers + PEFT's),
an unknown name is a 404 in OpenAI's shape, and with ``PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING`` the
load / unload endpoints (behind ``--api-key``) add and remove adapters."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from pagedllm.config import EngineArgs
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.serving_lora import LoRAModules, parse_lora_module
from tests.helpers import make_tiny_model
from tests.lora.adapters import PeftReference, make_adapter

pytestmark = pytest.mark.timeout(600)

API_KEY = "lora-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [400, 500, 600, 700]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_server")
    base = make_tiny_model("llama", root / "base")
    adapters = {"sql": make_adapter(base, root / "sql", seed=1, rank=8),
                "chat": make_adapter(base, root / "chat", seed=2, rank=4, targets=("q_proj", "v_proj")),
                "big": make_adapter(base, root / "big", seed=3, rank=16)}
    engine = AsyncLLMEngine(LLMEngine.from_engine_args(EngineArgs(
        model=base, dtype="float32", max_model_len=256, kv_cache_memory=32 * 2**20, enable_lora=True,
        max_loras=2, max_lora_rank=8)), log_stats=False)
    yield base, adapters, engine, PeftReference(base, {k: v for k, v in adapters.items() if k != "big"})
    engine.shutdown()


@pytest.fixture(scope="module")
def client(setup, monkeypatch_module):
    base, adapters, engine, _ = setup
    monkeypatch_module.setenv("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    app = build_app(engine, api_key=API_KEY, shutdown_engine=False,
                    lora_modules=[f"sql={adapters['sql']}", f'{{"name": "chat", "path": "{adapters["chat"]}"}}'])
    with TestClient(app, headers=AUTH) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def complete(client, model: str, **extra):
    return client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 5,
                                                "temperature": 0, "ignore_eos": True, **extra})


def test_models_lists_the_adapters_with_the_base_model_as_parent(setup, client):
    base = setup[0]
    cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
    assert set(cards) == {base, "sql", "chat"}
    assert cards["sql"]["parent"] == base and cards["chat"]["parent"] == base and cards[base]["parent"] is None
    assert cards["sql"]["root"] == setup[1]["sql"]
    assert client.get("/v1/models/chat").json()["id"] == "chat"


def test_a_request_by_adapter_name_runs_that_adapter(setup, client):
    base, _, engine, reference = setup
    tokenizer = engine.get_tokenizer()
    texts = {}
    for model, adapter in [(base, None), ("sql", "sql"), ("chat", "chat")]:
        resp = complete(client, model)
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == model
        texts[model] = resp.json()["choices"][0]["text"]
        assert texts[model] == tokenizer.decode(reference.greedy(adapter, PROMPT, 5))
    assert len(set(texts.values())) == 3
    chat = client.post("/v1/chat/completions", json={"model": "sql", "max_tokens": 3,
                                                     "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["model"] == "sql"


def test_unknown_model_is_a_404_in_openai_shape(client):
    resp = complete(client, "no-such-adapter")
    assert resp.status_code == 404
    error = resp.json()["error"]
    assert error["param"] == "model" and error["code"] == "model_not_found" and "no-such-adapter" in error["message"]
    resp = client.post("/v1/completions", json={"model": "sql", "prompt": "x", "use_beam_search": True, "n": 2})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "use_beam_search"


def test_load_and_unload_adapters_at_runtime(setup, client):
    _, adapters, _, _ = setup
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": adapters["chat"]},
                       headers={"Authorization": "Bearer wrong"}).status_code == 401
    resp = client.post("/v1/load_lora_adapter", json={"lora_name": "chat2", "lora_path": adapters["chat"]})
    assert resp.status_code == 200 and resp.text == "Success: LoRA adapter 'chat2' added successfully."
    assert "chat2" in {c["id"] for c in client.get("/v1/models").json()["data"]}
    assert complete(client, "chat2").json()["choices"][0]["text"] == complete(client, "chat").json()["choices"][0]["text"]
    again = client.post("/v1/load_lora_adapter", json={"lora_name": "chat2", "lora_path": adapters["chat"]})
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    for path, message in [(adapters["big"], "above max_lora_rank"), ("/no/such/folder", "not a PEFT adapter")]:
        bad = client.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": path})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path", bad.text
        assert message in bad.json()["error"]["message"]
    resp = client.post("/v1/unload_lora_adapter", json={"lora_name": "chat2"})
    assert resp.status_code == 200 and resp.text == "Success: LoRA adapter 'chat2' removed successfully."
    assert complete(client, "chat2").status_code == 404
    gone = client.post("/v1/unload_lora_adapter", json={"lora_name": "chat2"})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"
    assert complete(client, "sql").status_code == 200  # the others still serve


def test_runtime_updates_are_off_without_the_env_var(setup, monkeypatch):
    engine = setup[2]
    monkeypatch.delenv("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    with TestClient(build_app(engine, shutdown_engine=False)) as client:
        resp = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": setup[1]["sql"]})
        assert resp.status_code == 404


def test_lora_modules_flag_forms_and_errors(setup):
    assert parse_lora_module("a=/p") == ("a", "/p", None)
    assert parse_lora_module('{"name": "a", "path": "/p", "base_model_name": "m"}') == ("a", "/p", "m")
    for bad in ("a", "=p", '{"name": "a"}', "{not json"):
        with pytest.raises(ValueError, match="^--lora-modules: "):
            parse_lora_module(bad)
    off = LoRAModules(None, None, "base", ["base"])  # an engine without --enable-lora
    with pytest.raises(ValueError, match="^--lora-modules: LoRA adapters need an engine started with --enable-lora"):
        off.add("a", setup[1]["sql"], field="--lora-modules")
    engine = setup[2]
    with pytest.raises(ValueError, match="^--lora-modules: .*rank 16"):
        build_app(engine, shutdown_engine=False, lora_modules=[f"big={setup[1]['big']}"])
