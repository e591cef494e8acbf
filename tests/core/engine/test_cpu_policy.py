"""The CPU fast paths are decided in the engine plan from the config's ``cpu:`` keys; the
environment variables (``LMPLUG_NATIVE_STEP``, ``LMPLUG_FUSED_CPU``) override a key when set."""

from __future__ import annotations

import pytest
import torch
from support.gguf_fixtures import write_tiny_gguf

from lmplug import LLM, EngineConfig, SamplingParams
from lmplug.engine.plan import CpuPolicy, cpu_policy
from lmplug.kit import fused_cpu
from lmplug.kit.native_step import NativeDecodeStep


@pytest.fixture
def no_overrides(monkeypatch):
    monkeypatch.delenv("LMPLUG_NATIVE_STEP", raising=False)
    monkeypatch.delenv("LMPLUG_FUSED_CPU", raising=False)
    return monkeypatch


def test_config_keys_decide_and_the_environment_overrides(no_overrides):
    cpu = EngineConfig.from_dict({"model": "m"}).cpu
    assert cpu_policy(cpu) == CpuPolicy(native_step=True, fused_ops=True)
    off = EngineConfig.from_dict({"model": "m", "cpu": {"native_step": False, "fused_ops": False}}).cpu
    assert cpu_policy(off) == CpuPolicy(native_step=False, fused_ops=False)
    no_overrides.setenv("LMPLUG_NATIVE_STEP", "0")
    assert cpu_policy(cpu) == CpuPolicy(native_step=False, fused_ops=True)
    no_overrides.setenv("LMPLUG_NATIVE_STEP", "1")
    no_overrides.setenv("LMPLUG_FUSED_CPU", "on")
    assert cpu_policy(off) == CpuPolicy(native_step=True, fused_ops=True)
    no_overrides.setenv("LMPLUG_FUSED_CPU", "")  # empty: not set
    assert cpu_policy(off).fused_ops is False


def test_unknown_cpu_key_is_refused():
    with pytest.raises(Exception, match="cpu.native"):
        EngineConfig.from_dict({"model": "m", "cpu": {"native": False}})


@pytest.mark.skipif(fused_cpu.library() is None, reason="no C compiler: no native step")
def test_the_plan_turns_the_native_step_and_fused_ops_off(tmp_path, no_overrides):
    path = tmp_path / "llama.gguf"
    write_tiny_gguf(path, "llama")
    engine = {"dtype": "float32", "device": "cpu", "max_model_len": 64,
              "quant": {"method": "gguf", "kernel": "native"}}
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    try:
        native = LLM(str(path), **engine)
        want = native.generate([[5, 17, 42]], greedy)[0].outputs[0].token_ids
        assert isinstance(native.engine.parts.model._native_step, NativeDecodeStep)
        assert native.engine.parts.plan.cpu == CpuPolicy()
        python = LLM(str(path), **engine, cpu={"native_step": False, "fused_ops": False})
        assert fused_cpu.active(torch.zeros(2)) is None  # the fused ops are off
        got = python.generate([[5, 17, 42]], greedy)[0].outputs[0].token_ids
        assert python.engine.parts.model._native_step is False
        assert got == want  # the Python layers give the same greedy tokens
    finally:
        fused_cpu.set_enabled(True)
