"""POST /v1/embeddings through the official ``openai`` client (in process: ``build_app`` around an
AsyncLLMEngine on a tiny random BERT sentence-transformers folder, driven by starlette's
TestClient), and the 400s naming the field for bad input."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from starlette.testclient import TestClient

from pagedllm.config import EngineArgs
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.api_server import build_app
from tests.embedding_helpers import SENTENCES, assert_close_embeddings, make_tiny_bert, st_embeddings

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = make_tiny_bert(tmp_path_factory.mktemp("embeddings-server"), "mean", normalize=True)
    config_path = Path(folder) / "config.json"  # allow dimensions (Matryoshka), as vLLM reads it
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "is_matryoshka": True}))
    return folder


@pytest.fixture(scope="module")
def http(folder):
    engine = AsyncLLMEngine(LLMEngine.from_engine_args(EngineArgs(model=folder, kv_cache_memory=16 * 2**20,
                                                                  served_model_name="tiny-bert")), log_stats=False)
    with TestClient(build_app(engine, max_waiting_requests=None)) as client:
        yield client


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(api_key="unused", base_url="http://testserver/v1", http_client=http)


def test_openai_client_embeddings_equal_sentence_transformers(client, folder):
    resp = client.embeddings.create(model="tiny-bert", input=SENTENCES)
    assert [d.index for d in resp.data] == list(range(len(SENTENCES)))
    assert_close_embeddings([d.embedding for d in resp.data], st_embeddings(folder, SENTENCES))
    assert resp.model == "tiny-bert" and resp.object == "list"
    assert resp.usage.prompt_tokens == resp.usage.total_tokens > len(SENTENCES)


def test_string_token_ids_and_base64_inputs(client, http):
    one = client.embeddings.create(model="tiny-bert", input=SENTENCES[0]).data[0].embedding
    ids = http.post("/tokenize", json={"prompt": SENTENCES[0]}).json()["tokens"]
    by_ids = client.embeddings.create(model="tiny-bert", input=ids).data[0].embedding
    by_id_lists = client.embeddings.create(model="tiny-bert", input=[ids, ids[:3]]).data
    np.testing.assert_allclose(by_ids, one, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(by_id_lists[0].embedding, one, rtol=1e-5, atol=1e-6)
    raw = http.post("/v1/embeddings", json={"input": SENTENCES[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, one, rtol=1e-6)
    # The openai client asks for base64 by default and decodes it itself.
    default = client.embeddings.create(model="tiny-bert", input=SENTENCES[0]).data[0].embedding
    np.testing.assert_allclose(default, one, rtol=1e-6)


def test_dimensions_truncate_and_normalize(client):
    full = client.embeddings.create(model="tiny-bert", input=SENTENCES[1]).data[0].embedding
    raw = client.embeddings.create(model="tiny-bert", input=SENTENCES[1], extra_body={"normalize": False})
    short = client.embeddings.create(model="tiny-bert", input=SENTENCES[1], dimensions=16).data[0].embedding
    assert len(full) == 64 and len(short) == 16
    expected = torch.nn.functional.normalize(torch.tensor(raw.data[0].embedding[:16]), dim=0)
    np.testing.assert_allclose(short, expected.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [101, 99999]}, "input"),
    ({"input": "x " * 200}, "input"),  # beyond max_model_len (128)
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": 65}, "dimensions"),
    ({"input": "hi", "dimensions": "8"}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "temperature": 0.5}, "temperature"),
    ({}, "input"),
])
def test_bad_input_is_a_400_naming_the_field(http, body, param):
    resp = http.post("/v1/embeddings", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.json()


def test_unknown_model_is_404_and_generation_routes_are_absent(http):
    resp = http.post("/v1/embeddings", json={"input": "hi", "model": "other"})
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "model"
    assert http.post("/v1/completions", json={"prompt": "hi"}).status_code == 404
    assert http.post("/v1/chat/completions", json={"messages": []}).status_code == 404


def test_a_generation_model_does_not_serve_embeddings(tmp_path):
    from tests.helpers import make_tiny_model

    folder = make_tiny_model("llama", tmp_path / "llama")
    engine = AsyncLLMEngine(LLMEngine.from_engine_args(EngineArgs(model=folder, kv_cache_memory=16 * 2**20)),
                            log_stats=False)
    with TestClient(build_app(engine, max_waiting_requests=None)) as http:
        assert http.post("/v1/embeddings", json={"input": "hi"}).status_code == 404


def test_a_model_without_matryoshka_refuses_dimensions(tmp_path):
    folder = make_tiny_bert(tmp_path, "cls", normalize=False)
    engine = AsyncLLMEngine(LLMEngine.from_engine_args(EngineArgs(model=folder, kv_cache_memory=16 * 2**20)),
                            log_stats=False)
    with TestClient(build_app(engine, max_waiting_requests=None)) as http:
        resp = http.post("/v1/embeddings", json={"input": "hi", "dimensions": 8})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "dimensions"
        assert "does not support matryoshka representation" in resp.json()["error"]["message"]
        assert engine.num_live_requests() == 0
