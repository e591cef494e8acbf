"""``lmplug serve`` on the demo model, talked to with the official ``openai`` client (and httpx
for what a client library would refuse to send): outputs equal ``LLM``'s, bad input gets an
OpenAI error body and never a 500, a client that leaves frees its KV."""

from __future__ import annotations

import json

import httpx
import pytest

from lmplug import SamplingParams

openai = pytest.importorskip("openai")

KEY = "test-key"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MAX_LEN = 256


def post(server, path: str, body=None, *, content: bytes | None = None, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    headers["Content-Type"] = "application/json"
    if content is None:
        content = json.dumps(body).encode()
    return httpx.post(server.v1 + path, content=content, headers=headers, timeout=120)


# -- outputs equal LLM's ---------------------------------------------------------------------------


def chat_texts(client, stream: bool, **kwargs) -> tuple[list[str], list[str]]:
    """Texts and finish reasons per choice, streamed or not."""
    if not stream:
        r = client.chat.completions.create(model="demo", messages=CHAT, **kwargs)
        return [c.message.content for c in r.choices], [c.finish_reason for c in r.choices]
    texts, reasons = {}, {}
    for chunk in client.chat.completions.create(model="demo", messages=CHAT, stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    return [texts[i] for i in sorted(texts)], [reasons[i] for i in sorted(reasons)]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_equals_llm(client, ref, stream):
    want = ref.chat(CHAT, SamplingParams(temperature=0, max_tokens=12))[0]
    texts, reasons = chat_texts(client, stream, temperature=0, max_tokens=12)
    assert texts == [want.text]
    assert reasons == [want.finish_reason]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_seeded_sampling_n2_equals_llm(client, ref, stream):
    params = SamplingParams(n=2, temperature=0.9, top_p=0.95, seed=12, max_tokens=10)
    want = ref.chat(CHAT, params)[0]
    texts, _ = chat_texts(client, stream, n=2, temperature=0.9, top_p=0.95, seed=12, max_completion_tokens=10)
    assert texts == [o.text for o in want.outputs]
    assert texts[0] != texts[1]  # two samples, not one twice


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_llm_for_several_prompts(client, ref, stream):
    prompts = ["The capital of France is", "1, 2, 3,"]
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=8, stop=["\n"])
    want = [o.text for o in ref.generate(prompts, params)]
    kwargs = {"model": "demo", "prompt": prompts, "temperature": 0.7, "seed": 5, "max_tokens": 8, "stop": "\n"}
    if stream:
        texts = {}
        for chunk in client.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
        got = [texts[0], texts[1]]
    else:
        got = [c.text for c in client.completions.create(**kwargs).choices]
    assert got == want


def test_completions_default_max_tokens_and_usage(client, ref):
    prompt = "Once upon a time"
    want = ref.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    r = client.completions.create(model="demo", prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == 16 and r.usage.total_tokens == r.usage.prompt_tokens + 16


def test_stream_include_usage(client):
    chunks = list(client.chat.completions.create(model="demo", messages=CHAT, stream=True, temperature=0,
                                                 max_tokens=5, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_logprobs_equal_llm(client, ref):
    want = ref.chat(CHAT, SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0]
    r = client.chat.completions.create(model="demo", messages=CHAT, temperature=0, max_tokens=4, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for entry, tid, row in zip(content, want.token_ids, want.logprobs):
        assert entry.logprob == pytest.approx(row[tid].logprob, abs=1e-5)
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
    assert "".join(e.token for e in content) == r.choices[0].message.content


def test_completion_logprobs_shape(client):
    r = client.completions.create(model="demo", prompt="Hello", temperature=0, max_tokens=3, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["demo"]
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(server.url + "/health", headers=auth).json() == {"status": "ok"}
    text = httpx.get(server.url + "/metrics", headers=auth).text
    for name in ("lmplug_http_requests_total", "lmplug_time_to_first_token_seconds_bucket",
                 "lmplug_time_per_output_token_seconds_bucket", "lmplug_kv_cache_usage_ratio",
                 "lmplug_num_requests_running", "lmplug_num_requests_waiting", "lmplug_prompt_tokens_total",
                 "lmplug_generation_tokens_total"):
        assert name in text


# -- bad input: an OpenAI error body, never a 500, and the server keeps serving ------------------

OK_CHAT = {"model": "demo", "messages": CHAT, "max_tokens": 2}
BAD = [
    # (id, path, body or raw bytes, status, param)
    ("malformed-json", "/chat/completions", b'{"messages": [', 400, None),
    ("not-an-object", "/chat/completions", b"[1, 2]", 400, None),
    ("nan", "/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
     400, None),
    ("temperature-string", "/chat/completions", {**OK_CHAT, "temperature": "hot"}, 400, "temperature"),
    ("n-float", "/chat/completions", {**OK_CHAT, "n": 1.5}, 400, "n"),
    ("messages-string", "/chat/completions", {**OK_CHAT, "messages": "hi"}, 400, "messages"),
    ("content-number", "/chat/completions", {**OK_CHAT, "messages": [{"role": "user", "content": 3}]},
     400, "messages[0].content"),
    ("empty-messages", "/chat/completions", {**OK_CHAT, "messages": []}, 400, "messages"),
    ("missing-messages", "/chat/completions", {"model": "demo"}, 400, "messages"),
    ("bad-role", "/chat/completions", {**OK_CHAT, "messages": [{"role": "robot", "content": "x"}]},
     400, "messages[0].role"),
    ("unknown-field", "/chat/completions", {**OK_CHAT, "temprature": 0.5}, 400, "temprature"),
    ("unsupported", "/completions", {"model": "demo", "prompt": "a", "suffix": "b"}, 400, "suffix"),
    ("top-k-invalid", "/chat/completions", {**OK_CHAT, "top_k": -3}, 400, "top_k"),
    ("max-tokens-zero", "/chat/completions", {**OK_CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-too-large", "/chat/completions", {**OK_CHAT, "max_tokens": MAX_LEN}, 400, "max_tokens"),
    ("prompt-too-long", "/completions", {"model": "demo", "prompt": "hello " * (MAX_LEN + 10)}, 400, "prompt"),
    ("prompt-wrong-type", "/completions", {"model": "demo", "prompt": 42}, 400, "prompt"),
    ("prompt-empty", "/completions", {"model": "demo", "prompt": ""}, 400, "prompt"),
    ("token-out-of-vocab", "/completions", {"model": "demo", "prompt": [1, 10**9]}, 400, "prompt"),
    ("stop-empty", "/completions", {"model": "demo", "prompt": "a", "stop": [""]}, 400, "stop"),
    ("unknown-model", "/chat/completions", {**OK_CHAT, "model": "gpt-9"}, 404, "model"),
    ("unknown-route", "/nope", {}, 404, None),
    ("body-too-large", "/completions", {"model": "demo", "prompt": "x" * (1 << 20)}, 413, None),
]


def check_error(resp: httpx.Response, status: int, param: str | None) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param and param.split("[")[0] in error["message"]


@pytest.mark.parametrize("path,body,status,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_an_openai_error(server, path, body, status, param):
    resp = post(server, path, content=body) if isinstance(body, bytes) else post(server, path, body)
    check_error(resp, status, param)
    assert post(server, "/completions", {"model": "demo", "prompt": "Hi", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_api_key_required_on_v1(server, key):
    for method, path in (("GET", "/models"), ("POST", "/chat/completions"), ("POST", "/completions")):
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        resp = httpx.request(method, server.v1 + path, json=OK_CHAT, headers=headers)
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "invalid_api_key"
    for path in ("/health", "/metrics"):  # behind the key too, unless made public
        assert httpx.request("GET", server.url + path, headers=headers).status_code == 401


def test_openai_client_raises_on_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="demo", messages=CHAT, max_tokens=10 * MAX_LEN)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=str(client.base_url), api_key="nope", max_retries=0).models.list()


# -- engine faults and departing clients ------------------------------------------------------------


def test_engine_error_fails_the_request_and_the_server_keeps_serving(server, client, monkeypatch):
    runner = server.engine.runner

    def broken(*args, **kwargs):
        monkeypatch.undo()  # fail once
        raise RuntimeError("simulated kernel fault")

    monkeypatch.setattr(runner, "execute", broken)
    resp = post(server, "/chat/completions", OK_CHAT)
    assert resp.status_code == 500 and "simulated kernel fault" in resp.json()["error"]["message"]
    assert resp.json()["error"]["type"] == "server_error"
    monkeypatch.setattr(runner, "execute", broken)
    with pytest.raises(openai.APIError, match="simulated kernel fault"):
        list(client.chat.completions.create(model="demo", messages=CHAT, max_tokens=3, stream=True))
    assert client.chat.completions.create(model="demo", messages=CHAT, max_tokens=2).choices[0].message.content
    assert server.wait_for(lambda: server.engine.kv.usage == 0)


def _aborts(server) -> float:
    return server.metric('lmplug_requests_finished_total{reason="abort"}')


def test_client_killed_mid_stream_aborts_and_frees_kv(server):
    before = _aborts(server)
    body = {**OK_CHAT, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.v1 + "/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few tokens in, then hang up
    assert any('"content"' in line for line in got)
    assert server.wait_for(lambda: _aborts(server) == before + 1)
    assert server.wait_for(lambda: server.metric("lmplug_kv_cache_usage_ratio") == 0
                           and server.metric("lmplug_num_requests_running") == 0)
    assert server.engine.kv.usage == 0 and not server.engine.has_unfinished_requests()


def test_client_gone_before_a_whole_response_aborts(server):
    before = _aborts(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.v1 + "/completions", json={"model": "demo", "prompt": "Hi", "max_tokens": 200,
                                                     "ignore_eos": True},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=httpx.Timeout(60, read=1.0))
    assert server.wait_for(lambda: _aborts(server) == before + 1)
    assert server.wait_for(lambda: server.engine.kv.usage == 0)
