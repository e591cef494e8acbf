"""The OpenAI sampling surface through the server on the demo model: presence / frequency /
repetition penalties, ``logit_bias``, ``min_tokens``, ``echo`` (with the prompt's logprobs) and
``top_logprobs`` reach the engine: each changes the output, and the answer equals ``LLM``'s with
the same ``SamplingParams`` (the engine's own parity with HF transformers is tested with the
engine). Bad values are a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

from lmplug import SamplingParams

openai = pytest.importorskip("openai")

KEY = "test-key"
MAX_LEN = 256
PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat sat"
CHAT = [{"role": "user", "content": "List some animals."}]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.v1 + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def complete(client, stream: bool = False, **kwargs) -> str:
    if not stream:
        return client.completions.create(model="demo", prompt=PROMPT, **kwargs).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(model="demo", prompt=PROMPT, stream=True,
                                                                          **kwargs) if c.choices)


# -- penalties and logit_bias -----------------------------------------------------------------------

BASE = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
ADJUSTMENTS = [
    # (id, OpenAI fields, vLLM extra fields, the SamplingParams they mean)
    ("presence", {"presence_penalty": 2.0}, {}, {"presence_penalty": 2.0}),
    ("frequency", {"frequency_penalty": 2.0}, {}, {"frequency_penalty": 2.0}),
    ("repetition", {}, {"repetition_penalty": 1.5}, {"repetition_penalty": 1.5}),
    ("sampled-mixed", {"temperature": 0.8, "seed": 4, "presence_penalty": -0.5, "frequency_penalty": 0.7}, {},
     {"temperature": 0.8, "seed": 4, "presence_penalty": -0.5, "frequency_penalty": 0.7}),
]


@pytest.fixture(scope="module")
def base_text(client):
    return complete(client, temperature=0, max_tokens=24, extra_body={"ignore_eos": True})


@pytest.mark.parametrize("fields,extra,params", [a[1:] for a in ADJUSTMENTS], ids=[a[0] for a in ADJUSTMENTS])
def test_penalties_change_the_output_and_equal_llm(client, ref, base_text, fields, extra, params):
    kwargs = {**BASE, **fields}
    got = complete(client, extra_body={"ignore_eos": True, **extra},
                   **{k: v for k, v in kwargs.items() if k != "ignore_eos"})
    want = ref.generate(PROMPT, SamplingParams(**{**BASE, **params}))[0].text
    assert got == want
    assert got != base_text


def test_logit_bias_equals_llm_and_streams_the_same(server, client, ref, base_text):
    tokenizer = server.engine.tokenizer
    dog = tokenizer.encode(" dog", add_special_tokens=False)
    first = tokenizer.encode(base_text, add_special_tokens=False)[0]
    bias = {str(dog[0]): 100, str(first): -100}
    got = complete(client, temperature=0, max_tokens=6, logit_bias=bias)
    assert got == tokenizer.decode(dog[:1]) * 6  # +100 wins every step
    want = ref.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, logit_bias=bias))[0].text
    assert complete(client, stream=True, temperature=0, max_tokens=6, logit_bias=bias) == got == want
    banned = complete(client, temperature=0, max_tokens=12, logit_bias={str(first): -100},
                      extra_body={"ignore_eos": True})
    assert tokenizer.encode(banned, add_special_tokens=False)[0] != first


def test_chat_penalties_equal_llm_streamed(client, ref):
    params = SamplingParams(temperature=0, max_tokens=16, presence_penalty=1.0, repetition_penalty=1.2)
    want = ref.chat(CHAT, params)[0].text
    got = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="demo", messages=CHAT, stream=True, temperature=0, max_tokens=16, presence_penalty=1.0,
        extra_body={"repetition_penalty": 1.2}) if c.choices)
    assert got == want


def test_min_tokens_holds_back_the_end(client, ref):
    ask = [{"role": "user", "content": "Say hi."}]
    short = client.chat.completions.create(model="demo", messages=ask, temperature=0, max_tokens=64)
    n = short.usage.completion_tokens
    assert short.choices[0].finish_reason == "stop" and n < 40
    r = client.chat.completions.create(model="demo", messages=ask, temperature=0, max_tokens=64,
                                       extra_body={"min_tokens": n + 8})
    assert r.usage.completion_tokens >= n + 8
    assert r.choices[0].message.content == ref.chat(ask, SamplingParams(temperature=0, max_tokens=64,
                                                                        min_tokens=n + 8))[0].text


# -- echo and logprobs ------------------------------------------------------------------------------


def test_echo_prepends_the_prompt(client, ref):
    want = ref.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5))[0].text
    assert complete(client, echo=True, temperature=0, max_tokens=5) == PROMPT + want
    chunks = [c for c in client.completions.create(model="demo", prompt=PROMPT, echo=True, stream=True,
                                                   temperature=0, max_tokens=5) if c.choices]
    assert chunks[0].choices[0].text == PROMPT  # the prompt is the first chunk
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + want


def test_echo_with_several_prompts_n2_and_token_ids(server, client, ref):
    ids = server.engine.tokenizer.encode("One two three", add_special_tokens=False)
    r = client.completions.create(model="demo", prompt=["Hello", "Bye"], n=2, echo=True, temperature=0.9, seed=3,
                                  max_tokens=3)
    want = [o.text for out in ref.generate(["Hello", "Bye"], SamplingParams(n=2, temperature=0.9, seed=3,
                                                                            max_tokens=3)) for o in out.outputs]
    assert [c.text for c in r.choices] == ["Hello" + want[0], "Hello" + want[1], "Bye" + want[2], "Bye" + want[3]]
    r = client.completions.create(model="demo", prompt=ids, echo=True, temperature=0, max_tokens=2)
    assert r.choices[0].text.startswith("One two three")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_echo_logprobs_start_with_the_prompt(server, client, ref, stream):
    k = 3
    want = ref.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, logprobs=k, prompt_logprobs=k))[0]
    kwargs = {"model": "demo", "prompt": PROMPT, "echo": True, "logprobs": k, "temperature": 0, "max_tokens": 4}
    if stream:
        tokens, values, tops, offsets, text = [], [], [], [], ""
        for chunk in client.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                text += c.text
                if c.logprobs is not None:
                    tokens += c.logprobs.tokens
                    values += c.logprobs.token_logprobs
                    tops += c.logprobs.top_logprobs
                    offsets += c.logprobs.text_offset
    else:
        c = client.completions.create(**kwargs).choices[0]
        text, lp = c.text, c.logprobs
        tokens, values, tops, offsets = lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
    prompt_ids = want.prompt_token_ids
    ids = prompt_ids + want.token_ids
    assert text == PROMPT + want.text
    assert len(tokens) == len(values) == len(tops) == len(offsets) == len(ids)
    assert tokens == [server.engine.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert values[0] is None and tops[0] is None  # nothing predicts the first prompt token
    rows = want.prompt_logprobs[1:] + want.logprobs
    for tid, row, value, top in zip(ids[1:], rows, values[1:], tops[1:]):
        assert value == pytest.approx(row[tid].logprob, abs=1e-5)
        assert 1 <= len(top) <= k + 1
    assert offsets[0] == 0 and offsets[len(prompt_ids)] == len(PROMPT)


def test_top_logprobs_20(client, ref):
    r = client.chat.completions.create(model="demo", messages=CHAT, temperature=0, max_tokens=3, logprobs=True,
                                       top_logprobs=20)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(e.top_logprobs) == 20 for e in content)
    want = ref.chat(CHAT, SamplingParams(temperature=0, max_tokens=3, logprobs=20))[0]
    for entry, tid, row in zip(content, want.token_ids, want.logprobs):
        assert entry.logprob == pytest.approx(row[tid].logprob, abs=1e-5)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
    lp = client.completions.create(model="demo", prompt="Hello", temperature=0, max_tokens=3, logprobs=5).choices[0]
    assert all(1 <= len(top) <= 5 for top in lp.logprobs.top_logprobs)


# -- bad values: a 400 naming the field -------------------------------------------------------------

OK = {"model": "demo", "messages": CHAT, "max_tokens": 2}
BAD = [
    # (id, body, param)
    ("presence-too-big", {**OK, "presence_penalty": 3}, "presence_penalty"),
    ("frequency-string", {**OK, "frequency_penalty": "1"}, "frequency_penalty"),
    ("repetition-zero", {**OK, "repetition_penalty": 0}, "repetition_penalty"),
    ("bias-key-not-id", {**OK, "logit_bias": {"dog": 1}}, "logit_bias"),
    ("bias-too-big", {**OK, "logit_bias": {"5": 200}}, "logit_bias"),
    ("bias-past-vocab", {**OK, "logit_bias": {"10000000": 5}}, "logit_bias"),
    ("stop-token-past-vocab", {**OK, "stop_token_ids": [10000000]}, "stop_token_ids"),
    ("min-tokens-over-max", {**OK, "min_tokens": 5}, "min_tokens"),
    ("completions-bias-past-vocab", {"model": "demo", "prompt": "x", "logit_bias": {"10000000": 5}}, "logit_bias"),
    ("completions-logprobs-21", {"model": "demo", "prompt": "x", "logprobs": 21}, "logprobs"),
]


@pytest.mark.parametrize("body,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_values_are_a_400_naming_the_field(server, body, param):
    path = "/completions" if "prompt" in body else "/chat/completions"
    for stream in (False, True):
        resp = post(server, path, {**body, "stream": stream})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == param and param in error["message"]
    assert post(server, "/chat/completions", OK).status_code == 200


# -- prompt compression (the ``compression`` extra field) -------------------------------------------

LONG = ("Alpha beta gamma delta. " * 30) + "\n\nWhat is the first word?"


def test_compression_shortens_the_prompt_and_reports_both_counts(server, client, ref):
    body = {"model": "demo", "prompt": LONG, "max_tokens": 4, "temperature": 0,
            "compression": {"method": "truncate", "rate": 0.5}}
    r = post(server, "/completions", body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    full = len(ref.tokenizer.encode(LONG))
    assert usage["prompt_tokens_before_compression"] == full
    assert full * 0.45 < usage["prompt_tokens"] < full * 0.65  # the question is protected, the rest halved
    # the protected final question reaches the model; usage without compression has no extra key
    plain = client.completions.create(model="demo", prompt=PROMPT, max_tokens=2)
    assert "prompt_tokens_before_compression" not in plain.usage.model_dump(exclude_unset=True)
    chat = post(server, "/chat/completions", {"model": "demo", "max_tokens": 2, "compression": "truncate",
                                               "messages": [{"role": "user", "content": LONG}]}).json()
    assert chat["usage"]["prompt_tokens"] < chat["usage"]["prompt_tokens_before_compression"]


@pytest.mark.parametrize("field, param", [
    ({"method": "truncate", "rate": 1.5}, "compression.rate"),
    ({"method": "no-such-method"}, "compression.method"),
    ({"method": "truncate", "protect": ["not in the prompt"]}, "compression.protect"),
    ({"method": "truncate", "speed": 2}, "compression.speed"),
    (17, "compression"),
])
def test_bad_compression_is_a_400_naming_the_field(server, field, param):
    r = post(server, "/completions", {"model": "demo", "prompt": LONG, "max_tokens": 2, "compression": field})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
