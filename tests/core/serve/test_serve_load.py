"""The server under load and at shutdown, on a tiny random llama with a tokenizer and a chat
template: 32 concurrent streaming clients, every answer checked against ``LLM.generate`` for its
own prompt and seed; graceful shutdown (finish within the grace period, else cut with
``finish_reason="abort"``); ``lmplug serve`` as a real process stopped by SIGTERM."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from support.hf_models import get_model, one_torch_thread  # noqa: F401  (fixture)
from support.serve_util import running_server

from lmplug import LLM, SamplingParams
from lmplug.serve import ServeSettings
from lmplug.serve.loadgen import Job, format_summary, run_load, summarize

pytest.importorskip("openai")

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}. {% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
ENGINE = {"dtype": "float32", "device": "cpu", "max_model_len": 256,
              "kvcache": {"backend": "paged", "block_size": 16, "num_blocks": 512},
              "scheduler": {"backend": "continuous", "max_num_seqs": 32, "max_num_batched_tokens": 1024}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny llama with a tokenizer, copied so the chat template added here stays here."""
    src = get_model("llama", tmp_path_factory.mktemp("tiny"), tokenizer=True).path
    dst = tmp_path_factory.mktemp("serve") / "tiny-chat"
    shutil.copytree(src, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return dst


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), **ENGINE)


@pytest.fixture(scope="module")
def ref(model_dir):
    return LLM(str(model_dir), **ENGINE)


def make_jobs(count: int, seed: int = 0) -> tuple[list[Job], list]:
    """Chat and completion requests, greedy and seeded, each with its own prompt; and the
    prompts/params ``LLM.generate`` needs to answer each the same way."""
    rng = random.Random(seed)
    jobs, params = [], []
    for i in range(count):
        text = "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randrange(4, 40)))
        temperature = 0.0 if i % 3 == 0 else 0.8
        body = {"temperature": temperature, "seed": i, "max_tokens": 8}
        if i % 2:
            jobs.append(Job("chat", {**body, "messages": [{"role": "user", "content": text}]}))
        else:
            jobs.append(Job("completion", {**body, "prompt": text}))
        params.append(SamplingParams(temperature=temperature, seed=i, max_tokens=8))
    return jobs, params


def expected(ref: LLM, jobs: list[Job], params: list[SamplingParams]) -> list:
    prompts = [ref.apply_chat_template(j.body["messages"]) if j.kind == "chat" else j.body["prompt"]
               for j in jobs]
    return ref.generate(prompts, params)


def check_load(server, ref, num_requests: int, concurrency: int) -> dict:
    jobs, params = make_jobs(num_requests)
    want = expected(ref, jobs, params)
    results, wall = asyncio.run(run_load(server.v1, jobs, concurrency=concurrency))
    assert [r.error for r in results] == [None] * num_requests
    for job, result, out in zip(jobs, results, want):
        assert result.texts == {0: out.text}, job
        assert result.finish_reasons == {0: out.finish_reason}, job
        assert result.completion_tokens == len(out.token_ids), job
    assert server.wait_for(lambda: server.metric("lmplug_num_requests_running") == 0)
    assert server.metric("lmplug_kv_cache_usage_ratio") == 0 and server.engine.kv.usage == 0
    assert server.metric("lmplug_requests_finished_total") == num_requests
    assert not server.engine.has_unfinished_requests()
    return summarize(results, wall)


def test_load_32_streaming_clients(llm, ref, monkeypatch):
    batch_sizes = []
    step = llm.engine.step

    def counting_step():
        outputs = step()
        batch_sizes.append(len(outputs))
        return outputs

    monkeypatch.setattr(llm.engine, "step", counting_step)
    with running_server(llm) as server:
        stats = check_load(server, ref, num_requests=200, concurrency=32)
    assert max(batch_sizes) >= 16  # requests from different connections share steps
    print(f"\n[serve load] {format_summary(stats)}; largest batch {max(batch_sizes)}")


# -- graceful shutdown ----------------------------------------------------------------------------


def slow_steps(monkeypatch, engine, seconds: float) -> None:
    """Make each engine step take a while, so a request is surely in flight when we act."""
    execute = engine.runner.execute

    def slowly(*args, **kwargs):
        time.sleep(seconds)
        return execute(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", slowly)


def stream_after_shutdown(server, max_tokens: int) -> list[dict]:
    """Start a stream, ask the server to stop once tokens flow, read the stream to its end."""
    body = {"prompt": "abc", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    chunks = []
    with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                chunks.append({"done": True})
                break
            chunks.append(json.loads(line[6:]))
            if len(chunks) == 2:
                server.server.should_exit = True
    return chunks


def test_shutdown_lets_requests_finish_within_grace(llm, monkeypatch):
    slow_steps(monkeypatch, llm.engine, 0.02)
    with running_server(llm, ServeSettings(api_key="", shutdown_grace_s=30)) as server:
        chunks = stream_after_shutdown(server, max_tokens=30)
        server.thread.join(30)
        assert not server.thread.is_alive()
    assert chunks[-1] == {"done": True}
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"]) for c in chunks[:-1]) == 30  # one chunk per token, none lost
    assert llm.engine.kv.usage == 0


def test_shutdown_cuts_what_outlives_the_grace_period(llm, monkeypatch):
    slow_steps(monkeypatch, llm.engine, 0.02)
    with running_server(llm, ServeSettings(api_key="", shutdown_grace_s=0.3)) as server:
        started = time.monotonic()
        chunks = stream_after_shutdown(server, max_tokens=240)
        assert time.monotonic() - started < 4  # 240 steps would take ~5 s
    assert chunks[-1] == {"done": True}
    assert chunks[-2]["choices"][0]["finish_reason"] == "abort"
    assert llm.engine.kv.usage == 0 and not llm.engine.has_unfinished_requests()


# -- the real command ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_lmplug_serve_command_answers_and_stops_on_sigterm(model_dir):
    port = free_port()
    cmd = [sys.executable, "-m", "lmplug.cli", "serve", str(model_dir), "--port", str(port),
           "--device", "cpu", "--max-model-len", "256", "--api-key", "k", "--served-model-name", "tiny"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", headers={"Authorization": "Bearer k"}, timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        resp = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 3},
                          headers={"Authorization": "Bearer k"}, timeout=30)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1
        assert httpx.get(url + "/v1/models", timeout=5).status_code == 401
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "Traceback" not in out, out
    assert "Shutting down" in out
