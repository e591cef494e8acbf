"""Constraint compiles in worker processes (issue 45, item 1), through the real HTTP server: a
compile past ``max_compile_s`` is a 400 naming the limit and its worker process is killed (its CPU
use stops) and replaced; a backend that cannot read the model's tokenizer is a 400 naming the
backend and the tokenizer, not a 500."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from support.hf_models import get_model, one_torch_thread  # noqa: F401  (fixture)
from support.serve_util import running_server

from lmplug.serve import ServeSettings

BASE = {"prompt": "hi", "max_tokens": 4}
LONG_CHOICES = [f"option number {i} " + "x" * 200 for i in range(4096)]  # the probe's


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.v1 + "/completions", content=json.dumps(body).encode(), timeout=120,
                      headers={"Content-Type": "application/json"})


def serve(tmp_path_factory, **structured):
    model = get_model("llama", tmp_path_factory.mktemp("compile-pool"), tokenizer=True)
    return running_server(model.llm(kvcache="contiguous", structured_output=structured), ServeSettings(api_key=""))


def test_compile_past_the_limit_is_stopped_and_refused(tmp_path_factory):
    with serve(tmp_path_factory, backend="xgrammar", max_compile_s=0.05) as server:
        warm = post(server, {**BASE, "guided_choice": ["yes", "no"]})  # the worker is up
        assert warm.status_code == 200, warm.text
        worker = server.engine.constraints._pool._workers[0]._process
        assert worker.is_alive()
        resp = post(server, {**BASE, "guided_choice": LONG_CHOICES})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "guided_choice" and "max_compile_s" in error["message"], error
        assert not worker.is_alive() and not os.path.exists(f"/proc/{worker.pid}"), "the compile still runs"
        replaced = server.engine.constraints._pool._workers[0]._process
        assert replaced is not None and replaced.pid != worker.pid
        again = post(server, {**BASE, "guided_choice": ["red", "green"]})
        assert again.status_code == 200 and again.json()["choices"][0]["text"] in ("red", "green"), again.text


def test_unreadable_tokenizer_names_backend_and_tokenizer(tmp_path_factory):
    """llguidance cannot read the tiny model's tokenizer (a Fuse decoder)."""
    with serve(tmp_path_factory, backend="llguidance") as server:
        resp = post(server, {**BASE, "guided_regex": "[ab]+"})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "guided_regex", error
        assert "llguidance" in error["message"] and "tokenizer" in error["message"], error
        assert post(server, BASE).status_code == 200


@pytest.mark.parametrize("extra, limit", [
    ({"guided_choice": [f"c{i}" for i in range(200)]}, "max_enum_values"),
    ({"guided_regex": "(ab{200}){200}"}, "max_repeat"),
    ({"guided_grammar": 'root ::= "x" ' + " ".join(['"y"'] * 3000)}, "max_grammar_chars"),
], ids=["choices", "repeat", "grammar-size"])
def test_limits_are_checked_before_compiling(tmp_path_factory, monkeypatch, extra, limit):
    with serve(tmp_path_factory, backend="xgrammar", max_grammar_chars=10_000, max_enum_values=100) as server:
        worker = server.engine.constraints._start_pool()._workers[0]
        submitted = []
        monkeypatch.setattr(worker, "check", lambda spec, seconds: submitted.append(spec))
        resp = post(server, {**BASE, **extra})
        assert resp.status_code == 400, resp.text
        assert limit in resp.json()["error"]["message"], resp.json()
        assert not submitted, "the constraint was sent to the compile worker"
