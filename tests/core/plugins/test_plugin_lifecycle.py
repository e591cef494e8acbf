"""The plugin manager's lifecycle hooks: configure, engine started, step and request finished."""

from __future__ import annotations

import pytest
from support.fake_plugins import FIRST_PARTY, _need_model_cache

import lmplug
from lmplug import ConfigError, EngineConfig, SamplingParams, hookimpl
from lmplug.api import EngineView
from lmplug.plugins import API_VERSION, get_registry, reset_registry

# -- lifecycle hooks -------------------------------------------------------------------------------


class Recorder:
    LMPLUG_API_VERSION = API_VERSION

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    @hookimpl
    def lmplug_configure(self, config):
        self.calls.append(("configure", {"config": config}))

    @hookimpl
    def lmplug_engine_started(self, engine):
        self.calls.append(("engine_started", {"engine": engine}))

    @hookimpl
    def lmplug_step_finished(self, engine, stats):
        self.calls.append(("step_finished", {"engine": engine, "stats": dict(stats)}))

    @hookimpl
    def lmplug_request_finished(self, engine, output):
        self.calls.append(("request_finished", {"engine": engine, "output": output}))


def test_lifecycle_hooks(tiny_llama, tmp_path):
    _need_model_cache()
    rec = Recorder()
    assert get_registry().register(rec, name="recorder")
    llm = lmplug.LLM(
        model=str(tiny_llama),
        device="cpu",
        dtype="float32",
        max_model_len=64,
        config={"model": "x", "scheduler": {"max_num_seqs": 4}},
    )
    engine = llm.engine
    kinds = [k for k, _ in rec.calls]
    assert kinds == ["configure", "engine_started"]
    config = rec.calls[0][1]["config"]
    assert isinstance(config, EngineConfig) and config.model == str(tiny_llama)
    assert config.max_model_len == 64 and config.scheduler == {"max_num_seqs": 4}
    view = rec.calls[1][1]["engine"]  # a read-only view of the engine, not the engine
    assert isinstance(view, EngineView) and view is engine.view
    assert view.config is engine.config and view.model_config is engine.model_config
    assert view.max_model_len == engine.max_model_len == 64
    assert view.backends == {f: b.name for f, b in engine.resolved.backends.items()}
    assert view.backends["attention"] == engine.resolved.backends["attention"].name
    assert not hasattr(view, "kv") and not hasattr(view, "scheduler") and not hasattr(view, "__dict__")

    outs = llm.generate(
        [[1, 2, 3], [1, 4, 5, 6]],
        [
            SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        ],
    )
    steps = [d for k, d in rec.calls if k == "step_finished"]
    finished = [d for k, d in rec.calls if k == "request_finished"]
    assert len(steps) >= 5
    keys = {
        "num_running",
        "num_waiting",
        "num_prefill_tokens",
        "num_decode_tokens",
        "kv_usage",
        "step_time_s",
    }
    for d in steps:
        assert d["engine"] is view
        assert set(d["stats"]) >= keys
        assert 0.0 <= d["stats"]["kv_usage"] <= 1.0 and d["stats"]["step_time_s"] >= 0
    assert sum(d["stats"]["num_prefill_tokens"] for d in steps) >= 7  # both prompts were computed
    assert sum(d["stats"]["num_decode_tokens"] for d in steps) > 0
    # once per request, with its final output
    assert sorted(d["output"].request_id for d in finished) == sorted(o.request_id for o in outs)
    for d in finished:
        assert d["engine"] is view and d["output"].finished
    by_id = {d["output"].request_id: d["output"] for d in finished}
    assert [by_id[o.request_id].token_ids for o in outs] == [o.token_ids for o in outs]
    assert [len(o.token_ids) for o in outs] == [3, 5]
    assert view.stats == engine.last_stats == steps[-1]["stats"]  # the last step's, a copy
    assert view.stats is not engine.last_stats
    assert kinds == ["configure", "engine_started"]  # the first two calls, unchanged


def test_configure_hook_can_abort_startup(tmp_path):
    class Veto:
        LMPLUG_API_VERSION = API_VERSION

        @hookimpl
        def lmplug_configure(self, config):
            raise ConfigError(f"veto plugin: model {config.model!r} is not allowed here")

    get_registry().register(Veto(), name="veto")
    # configure runs before any model is opened, so no model is needed
    with pytest.raises(
        ConfigError, match="veto plugin: model '/no/such/model' is not allowed here"
    ):
        lmplug.LLM(model="/no/such/model", device="cpu", dtype="float32")


def test_reset_registry_forgets_in_process_plugins():
    rec = Recorder()
    get_registry().register(rec, name="recorder")
    assert get_registry().pm.get_plugin("recorder") is rec
    reset_registry()
    assert get_registry().pm.get_plugin("recorder") is None
    assert FIRST_PARTY <= set(dict(get_registry().pm.list_name_plugin()))
