"""Pipeline parallelism when it cannot run: a stage that dies ends every request in flight with an
error naming its rank, within ``parallel.timeout_s``, while the server keeps answering /health;
layouts that cannot split are refused at load, naming the option and the numbers."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
from support.hf_models import get_model, one_torch_thread  # noqa: F401
from support.pipeline_models import save
from support.tensor_parallel import ENGINE, children

from lmplug import LLM, ConfigError
from lmplug.parallel.pipeline import layer_counts

pytestmark = pytest.mark.hf


def test_even_split_gives_the_remainder_to_the_first_stages():
    assert layer_counts(30, 4, None, "m") == [8, 8, 7, 7]
    assert layer_counts(4, 3, None, "m") == [2, 1, 1]
    assert layer_counts(30, 1, None, "m") == [30]
    assert layer_counts(4, 2, [3, 1], "m") == [3, 1]


def test_cli_flags_and_config_keys():
    """``--pp`` / ``--pp-size`` beside ``--tp`` fill the ``parallel`` section; the section refuses
    sizes below 1 naming the key."""
    from lmplug.cli import _overrides, _parser
    from lmplug.config import EngineConfig

    for flag in ("--pp", "--pp-size"):
        args = _parser().parse_args(["generate", "m", flag, "2", "--tp", "3", "--set", "parallel.timeout_s=9"])
        assert _overrides(args)["parallel"] == {"pipeline_parallel_size": 2, "tensor_parallel_size": 3,
                                                "timeout_s": 9}
    cfg = EngineConfig.from_dict({"model": "m", "parallel": {"pipeline_parallel_size": 2, "pipeline_layers": [3, 1]}})
    assert cfg.parallel.pipeline_layers == [3, 1]
    with pytest.raises(ConfigError, match="pipeline_parallel_size"):
        EngineConfig.from_dict({"model": "m", "parallel": {"pipeline_parallel_size": 0}})


def test_bad_layouts_are_refused_at_load(tmp_path):
    path = save(tmp_path, "llama")  # 4 layers
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=5 is more than the 4 layers"):
        LLM(str(path), **ENGINE, pipeline_parallel_size=5)  # vLLM's keyword
    with pytest.raises(ConfigError, match=r"pipeline_layers lists 3 stages \[1, 1, 2\], but "
                                          r"parallel.pipeline_parallel_size is 2"):
        LLM(str(path), **ENGINE, parallel={"pipeline_parallel_size": 2, "pipeline_layers": [1, 1, 2]})
    with pytest.raises(ConfigError, match=r"pipeline_layers \[1, 2\] sums to 3 layers, but .* has 4"):
        LLM(str(path), **ENGINE, parallel={"pipeline_parallel_size": 2, "pipeline_layers": [1, 2]})
    with pytest.raises(ConfigError, match=r"pipeline_layers \[4, 0\]: every stage needs at least one layer"):
        LLM(str(path), **ENGINE, parallel={"pipeline_parallel_size": 2, "pipeline_layers": [4, 0]})
    # a drafter that runs the target's own first layers: they live on the first stage only
    with pytest.raises(ConfigError, match=r"speculative 'layer_skip'.*use one of ngram, draft_model"):
        LLM(str(path), **ENGINE, parallel={"pipeline_parallel_size": 2},
            speculative={"method": "layer_skip", "num_tokens": 3, "num_layers": 1})
    assert children() == []


def test_sizes_must_match_torchrun(tmp_path, monkeypatch):
    path = save(tmp_path, "llama")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=2 x parallel.tensor_parallel_size=2 = 4 "
                                          r"processes, but torchrun started WORLD_SIZE=3"):
        LLM(str(path), **ENGINE, parallel={"pipeline_parallel_size": 2, "tensor_parallel_size": 2})


@pytest.mark.slow
def test_killed_stage_fails_every_request_and_health_says_so(tmp_path):
    """PP=2 behind the real server: SIGKILL of the second stage's process while 4 requests stream
    ends each with an error naming rank 1 within the timeout; /health answers 503 with the reason."""
    from support.serve_util import running_server

    path = get_model("llama", tmp_path, tokenizer=True).path
    timeout_s = 20.0
    llm = LLM(str(path), **ENGINE, parallel={"pipeline_parallel_size": 2, "timeout_s": timeout_s})
    worker = llm.engine.parallel.procs[1]
    results: list = [None] * 4
    with running_server(llm) as srv:
        assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
        body = {"model": str(path), "prompt": "a b c", "max_tokens": 100, "temperature": 0, "ignore_eos": True}

        def ask(i: int) -> None:
            results[i] = httpx.post(srv.v1 + "/completions", json=body, timeout=120)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        assert srv.wait_for(lambda: srv.engine.has_unfinished_requests()), results
        time.sleep(0.3)
        killed = time.monotonic()
        os.kill(worker.pid, signal.SIGKILL)
        for t in threads:
            t.join(timeout_s + 10)
        assert time.monotonic() - killed < timeout_s
        for r in results:
            assert r is not None and r.status_code >= 500, r
            assert "rank 1 (stage 1 of 2)" in r.text and "SIGKILL" in r.text, r.text
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "parallel_worker_failed"
        assert "rank 1" in health.json()["detail"]
    llm.close()
    assert children() == []
