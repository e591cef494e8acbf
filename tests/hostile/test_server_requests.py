"""One request never hurts another, through the real HTTP server: out-of-range fields are a
400 naming the field (never a 500 for everyone), limits on sequences and stop strings hold,
a request that fails in the engine fails alone, and a small request is served while a big
one runs."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from support.hf_models import get_model, one_torch_thread  # noqa: F401  (fixture)
from support.serve_util import running_server

from lmplug.serve import ServeSettings
from lmplug.serve.convert import MAX_PROMPTS, MAX_REQUEST_SEQS


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return get_model("llama", tmp_path_factory.mktemp("hostile-serve"), tokenizer=True)


@pytest.fixture(scope="module")
def server(model):
    llm = model.llm(kvcache="contiguous", scheduler={"backend": "continuous", "max_num_seqs": 4})
    with running_server(llm, ServeSettings(api_key="", max_num_seqs=80)) as running:
        yield running


def post(server, body, *, raw: bytes | None = None, timeout: float = 120) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(server.v1 + "/completions", content=content, timeout=timeout,
                      headers={"Content-Type": "application/json"})


def ok(server) -> None:
    resp = post(server, {"prompt": [5, 6, 7], "max_tokens": 2})
    assert resp.status_code == 200, resp.text


def check_400(resp: httpx.Response, param: str | None) -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param and param in error["message"]


BASE = {"prompt": [5, 6, 7], "max_tokens": 2}
BAD = [
    ("top-k-2**63", {**BASE, "top_k": 2**63}, "top_k"),
    ("seed-2**64", {**BASE, "seed": 2**64}, "seed"),
    ("seed-negative", {**BASE, "seed": -1}, "seed"),
    # 1e999 is valid JSON that Python reads as inf (json.dumps would write "Infinity")
    ("min-p-inf", b'{"prompt": [5, 6, 7], "min_p": 1e999}', "min_p"),
    ("temperature-inf", b'{"prompt": [5, 6, 7], "temperature": 1e999}', "temperature"),
    ("top-p-inf", b'{"prompt": [5, 6, 7], "top_p": 1e999}', "top_p"),
    ("n-x-prompts", {"prompt": ["hi"] * MAX_PROMPTS, "n": 64, "max_tokens": 1}, "n"),
    ("stop-strings-100k", {**BASE, "stop": [f"s{i}" for i in range(100_000)]}, "stop"),
    ("stop-string-long", {**BASE, "stop": ["x" * 5000]}, "stop"),
]


@pytest.mark.parametrize("body, param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_out_of_range_is_a_400_naming_the_field(server, body, param):
    check_400(post(server, None, raw=body) if isinstance(body, bytes) else post(server, body), param)
    ok(server)


def test_lone_surrogate_prompt_is_a_400(server):
    check_400(post(server, None, raw=b'{"prompt": "a\\udc80b", "max_tokens": 2}'), "prompt")
    check_400(post(server, None, raw=b'{"prompt": ["ok", "a\\udc80b"], "max_tokens": 2}'), "prompt")
    ok(server)


def test_deeply_nested_json_is_a_400(server):
    check_400(post(server, None, raw=b"[" * 100_000 + b"]" * 100_000), None)
    check_400(post(server, None, raw=b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), None)
    ok(server)


def test_request_limits_are_documented_values():
    assert MAX_REQUEST_SEQS == 64


def test_server_wide_sequence_limit(server):
    """Past ``ServeSettings.max_num_seqs`` (80 here), a request that would pass it while others
    run is a 429."""
    results = {}
    big = {"prompt": [[5, 6, 7]] * 8, "n": 8, "max_tokens": 40, "ignore_eos": True}
    thread = threading.Thread(target=lambda: results.update(big=post(server, big)))
    thread.start()
    assert server.wait_for(lambda: server.engine.scheduler.num_running > 0)
    resp = post(server, {"prompt": [[5, 6]] * 4, "n": 5, "max_tokens": 1})  # 64 + 20 > 80
    assert resp.status_code == 429, resp.text
    assert resp.json()["error"]["code"] == "too_many_sequences"
    thread.join(300)
    assert results["big"].status_code == 200
    ok(server)


def test_small_request_finishes_while_a_big_one_runs(server):
    """64 sequences from one client used to hold every slot: a 4-token request behind them
    timed out. Admission is round-robin across requests now."""
    results = {}
    big = {"prompt": [[5, 6, 7]] * 8, "n": 8, "max_tokens": 24, "ignore_eos": True}
    thread = threading.Thread(target=lambda: results.update(big=post(server, big)))
    thread.start()
    assert server.wait_for(lambda: server.engine.scheduler.num_running > 0)
    started = time.monotonic()
    small = post(server, {"prompt": [9, 10, 11], "max_tokens": 4, "ignore_eos": True})
    assert small.status_code == 200 and time.monotonic() - started < 60
    assert thread.is_alive(), "the small request should finish while the big one still runs"
    thread.join(300)
    assert results["big"].status_code == 200
    assert len(results["big"].json()["choices"]) == 64


def test_a_request_failing_in_the_engine_fails_alone(server, monkeypatch):
    """An exception in one request's rows used to fail every request in flight with a 500."""
    engine = server.engine
    real = engine.requests.append

    def append(seqs, *args):
        if seqs[0].params.max_tokens == 7:
            raise RuntimeError("Overflow when unpacking long long")
        return real(seqs, *args)

    monkeypatch.setattr(engine.requests, "append", append)
    results = {}
    bodies = {"bad": {"prompt": [5, 6, 7], "max_tokens": 7},
              **{f"ok{i}": {"prompt": [5 + i, 6, 7], "max_tokens": 6, "ignore_eos": True} for i in range(3)}}
    threads = [threading.Thread(target=lambda k=k, b=b: results.update({k: post(server, b)}))
               for k, b in bodies.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert results["bad"].status_code == 500
    assert results["bad"].json()["error"]["code"] == "engine_error"
    for i in range(3):
        resp = results[f"ok{i}"]
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["finish_reason"] == "length"
