"""The OpenAI-compatible endpoint (engine/inference/serve.py) through a real ASGI client: completions
equal the engine's greedy tokens, streaming sends SSE chunks then [DONE], concurrent requests share the
batch, and bad requests get 4xx with a one-line reason."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from fastapi.testclient import TestClient

from deepfleet.engine import init_inference
from deepfleet.engine.compression.generate import greedy_generate
from deepfleet.engine.inference.serve import create_app
from examples.gpt.model import GPTConfig, TinyGPT


@pytest.fixture(scope="module")
def served():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=300, seq_len=64, d_model=32, n_heads=4, n_layers=2)).eval()
    engine = init_inference(model, dtype=torch.float32, max_out_tokens=64, max_batch_size=4)
    with TestClient(create_app(engine, model_name="tiny")) as client:
        yield model, client


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    return greedy_generate(model, torch.tensor([prompt]), max_new_tokens=n, max_context=64)[0, len(prompt):].tolist()


def test_completion_with_token_ids_is_the_greedy_continuation(served):
    model, client = served
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    expected = _greedy(model, [5, 6, 7], 6)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert body["choices"][0]["text"] == bytes(t for t in expected if t < 256).decode("utf-8", errors="replace")


def test_streaming_sends_sse_chunks_then_done(served):
    model, client = served
    prompt = "hi"
    with client.stream("POST", "/v1/completions",
                       json={"prompt": prompt, "max_tokens": 5, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert len(chunks) == 5 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    expected = _greedy(model, list(prompt.encode()), 5)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == bytes(t for t in expected if t < 256).decode("utf-8", errors="replace")


def test_concurrent_requests_each_get_their_own_tokens(served):
    model, client = served
    prompts = [[3, 4, 5], [9, 8, 7, 6, 5], [100], [42, 43]]
    results: dict[int, list] = {}

    def ask(i):
        r = client.post("/v1/completions", json={"prompt": prompts[i], "max_tokens": 4 + i, "temperature": 0})
        results[i] = r.json()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for i, p in enumerate(prompts):
        expected = _greedy(model, p, 4 + i)
        assert results[i]["choices"][0]["text"] == bytes(t for t in expected if t < 256).decode("utf-8", errors="replace")
        assert results[i]["usage"]["completion_tokens"] == 4 + i


@pytest.mark.parametrize(("payload", "status", "field"), [
    ({"prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": [1, 2], "best_of": 3}, 400, "best_of"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": [1, 2], "n": 2}, 400, "n"),
    ({"prompt": [999], "max_tokens": 2}, 400, "prompt"),
    ({"prompt": [1, 2], "max_tokens": 500}, 400, "max_tokens"),
    ({"prompt": [1, 2], "model": "other"}, 404, "model"),
])
def test_bad_requests_get_4xx_with_a_one_line_reason(served, payload, status, field):
    _, client = served
    r = client.post("/v1/completions", json=payload)
    assert r.status_code == status
    message = r.json()["error"]["message"]
    assert message.startswith(f"{field}: ") and "\n" not in message
    assert r.json()["error"]["param"] == field


def test_malformed_json_is_a_400(served):
    _, client = served
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "body: is not valid JSON; send a JSON object"


def test_with_api_keys_every_v1_request_needs_one_of_them(served):
    """OpenAI clients send `Authorization: Bearer <key>`; without one of the endpoint's keys a request
    gets 401 with OpenAI's error body, and with one (either of two, as during a rotation) it is served."""
    from deepfleet.engine.inference.serve import api_keys_from

    model, _ = served
    assert api_keys_from(" sk-a, ,sk-b ") == ("sk-a", "sk-b") and api_keys_from(None) == ()
    engine = init_inference(model, dtype=torch.float32, max_out_tokens=64, max_batch_size=2)
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
    with TestClient(create_app(engine, model_name="tiny", api_keys=api_keys_from("sk-a,sk-b"))) as client:
        for headers in ({}, {"Authorization": "Bearer sk-c"}, {"Authorization": "Basic sk-a"},
                        {"Authorization": "Bearer"}, {"Authorization": "Bearer sk-a-longer"}):
            for r in (client.post("/v1/completions", json=body, headers=headers),
                      client.get("/v1/models", headers=headers)):
                assert r.status_code == 401, (headers, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
                error = r.json()["error"]
                assert error["code"] == "invalid_api_key" and error["message"].startswith("Authorization: ")
                assert "\n" not in error["message"] and "sk-a" not in error["message"]
        for key in ("sk-a", "sk-b"):
            r = client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
        assert client.get("/v1/models", headers={"Authorization": "bearer sk-b"}).status_code == 200
