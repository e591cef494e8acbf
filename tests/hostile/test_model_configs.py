"""Hostile or broken config.json values fail before anything is built, with a ModelLoadError
naming the file and the key. Integral strings and floats ("64", 64.0) are refused, not coerced."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from support.hf_models import get_model, one_torch_thread  # noqa: F401

from lmplug import LLM, ModelLoadError
from lmplug.engine.architecture import model_config_of
from lmplug.loading import memory

BASE = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6}
WHERE = "/models/x/config.json"


def refused(**changes) -> str:
    cfg = {**BASE, **changes}
    with pytest.raises(ModelLoadError) as info:
        model_config_of(cfg, WHERE)
    msg = str(info.value)
    assert msg.startswith(WHERE), msg
    return msg


def test_base_parses():
    mc = model_config_of(dict(BASE), WHERE)
    assert (mc.head_dim, mc.num_kv_heads, mc.sliding_window) == (16, 2, None)


@pytest.mark.parametrize("key, value", [
    ("num_attention_heads", 0),  # before: ZeroDivisionError
    ("hidden_size", "64"),  # before: coerced silently
    ("hidden_size", 64.5),  # before: truncated to 64 silently
    ("hidden_size", 64.0),
    ("hidden_size", True),
    ("vocab_size", -5),
    ("num_hidden_layers", 0),  # before: a model with no layers loaded silently
    ("num_hidden_layers", 10**6),  # before: a minute building layers
    ("hidden_size", 10**9),  # before: torch's allocator message without the key
    ("vocab_size", 10**9),
    ("num_key_value_heads", 3),  # does not divide 4 heads
    ("num_attention_heads", 6),  # does not divide hidden_size 64 (no head_dim)
    ("rope_theta", -1.0),  # before: loaded silently
    ("rope_theta", float("nan")),
    ("rope_theta", "big"),
    ("rms_norm_eps", 0),
    ("sliding_window", 0),  # before: loaded silently, as "no window"
    ("sliding_window", "16"),
    ("quantization_config", "gptq"),  # before: AttributeError in the plan
    ("quantization_config", [1]),
    ("rope_scaling", "linear"),
    ("tie_word_embeddings", "false"),  # before: bool("false") is True
    ("max_position_embeddings", 10**12),
])
def test_bad_value_names_the_key(key, value):
    assert repr(key) in refused(**{key: value})


def test_missing_key():
    cfg = dict(BASE)
    del cfg["hidden_size"]
    with pytest.raises(ModelLoadError, match=r"config.json: 'hidden_size' is missing"):
        model_config_of(cfg, WHERE)


def test_deep_nesting():
    deep: dict = {}
    node = deep
    for _ in range(200):
        node["x"] = {}
        node = node["x"]
    assert "'extra'" in refused(extra=deep) and "nested" in refused(extra=deep)


def test_moe_and_mla_values_checked():
    with pytest.raises(ModelLoadError, match=r"config.json: 'num_local_experts'"):
        model_config_of({**BASE, "model_type": "mixtral", "num_local_experts": "8",
                             "num_experts_per_tok": 2}, WHERE)
    with pytest.raises(ModelLoadError, match=r"config.json: 'num_experts_per_tok'.*exceeds"):
        model_config_of({**BASE, "model_type": "mixtral", "num_local_experts": 2,
                             "num_experts_per_tok": 4}, WHERE)
    with pytest.raises(ModelLoadError, match=r"config.json: 'kv_lora_rank'"):
        model_config_of({**BASE, "model_type": "deepseek_v2", "num_key_value_heads": 4,
                             "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
                             "kv_lora_rank": 0}, WHERE)


def test_qwen_unused_window_is_ignored():
    mc = model_config_of({**BASE, "model_type": "qwen2", "sliding_window": 0,
                              "use_sliding_window": False}, WHERE)
    assert mc.sliding_window is None


# -- the memory check -------------------------------------------------------------------------------

def test_memory_check_names_the_size_keys(monkeypatch):
    mc = model_config_of(dict(BASE), WHERE)
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1000)
    with pytest.raises(ModelLoadError) as info:
        memory.check_fits(mc, WHERE, torch.float32, torch.device("cpu"))
    msg = str(info.value)
    assert msg.startswith(WHERE) and "hidden_size=64" in msg and "num_hidden_layers=2" in msg
    monkeypatch.setattr(memory, "available_bytes", lambda device: 10**9)
    memory.check_fits(mc, WHERE, torch.float32, torch.device("cpu"))


def test_estimate_is_a_lower_bound_of_the_real_model(tmp_path):
    tiny = get_model("llama", tmp_path)
    real = sum(p.numel() * p.element_size() for p in tiny.hf.parameters())
    estimate = memory.estimated_bytes(model_config_of(tiny.config), torch.float32, quantized=False)
    assert 0.9 * real <= estimate <= real


# -- through LLM(...): the file's path is in the message ----------------------------------------------

@pytest.fixture
def model_dir(tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    dest = tmp_path / "model"
    shutil.copytree(get_model("llama", root).path, dest)
    return dest


def load_with(model_dir, **changes) -> str:
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    started = time.perf_counter()
    with pytest.raises(ModelLoadError) as info:
        LLM(str(model_dir), dtype="float32", device="cpu", max_model_len=64)
    assert time.perf_counter() - started < 30  # refused before building anything
    return str(info.value)


@pytest.mark.parametrize("key, value", [("num_attention_heads", 0), ("num_hidden_layers", 10**6),
                                        ("quantization_config", "gptq"), ("sliding_window", 0)])
def test_llm_names_the_file_and_key(model_dir, key, value):
    msg = load_with(model_dir, **{key: value})
    assert str(model_dir / "config.json") in msg and repr(key) in msg


def test_llm_refuses_a_model_larger_than_memory(model_dir):
    # within every bound, but ~2 TB of float32 weights
    msg = load_with(model_dir, vocab_size=1 << 22, hidden_size=1 << 16, num_attention_heads=64,
                    num_key_value_heads=8, head_dim=1024, intermediate_size=1 << 18)
    assert str(model_dir / "config.json") in msg and "hidden_size=65536" in msg and "GiB" in msg
