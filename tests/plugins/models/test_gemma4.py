"""Native Gemma 4 text through the architecture conformance kit (transformers' outputs at 1e-4,
32 greedy tokens, batched = alone with chunked prefill, paged = contiguous, preemption), dense and
MoE, under ``sdpa`` and ``paged``; the KV cache holding layers of two shapes; bad configs."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from lmplug.testing.architecture import ArchitectureConformance, build_tiny

pytestmark = [pytest.mark.hf]

SLIDING, FULL = "sliding_attention", "full_attention"
ROPES = {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
         FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
BASE: dict[str, Any] = {
    "model_type": "gemma4_text", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 256, "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0, "sliding_window": 8, "hidden_size_per_layer_input": 0, "global_head_dim": 32,
    "layer_types": [SLIDING, FULL, SLIDING, FULL], "rope_parameters": ROPES,
}
# full layers: head_dim 32 and one KV head, K used as V; a final soft-cap
K_EQ_V = {**BASE, "attention_k_eq_v": True, "num_global_key_value_heads": 1, "final_logit_softcapping": 5.0}
MOE = {**K_EQ_V, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}
CONFIGS = {
    "gemma4-k-eq-v": K_EQ_V,
    # transformers' default layer pattern (5:1, last layer forced full), full layers with V of their own
    "gemma4-default-pattern": {**{k: v for k, v in BASE.items() if k != "layer_types"}, "num_hidden_layers": 3},
    "gemma4-moe": MOE,
}


def build_gemma4(config: dict[str, Any], path: Path) -> Any:
    """``build_tiny``, then the per-layer ``layer_scalar`` buffers and the routers' scales (left at
    one by transformers' init, which would hide a loader that drops them) randomised and saved."""
    hf = build_tiny(config, path)
    with torch.no_grad():
        for name, tensor in [*hf.named_buffers(), *hf.named_parameters()]:
            if name.endswith(("layer_scalar", "router.scale", "per_expert_scale")):
                tensor.copy_(0.6 + 0.8 * torch.rand_like(tensor))
    hf.save_pretrained(path)
    return hf


class _Gemma4(ArchitectureConformance):
    backend = "gemma4"
    configs = CONFIGS

    @pytest.fixture(scope="class")
    @classmethod
    def tiny(cls):
        root = Path(tempfile.mkdtemp(prefix="lmplug-gemma4-"))
        return {name: (root / name, build_gemma4(config, root / name)) for name, config in cls.configs.items()}


@pytest.mark.slow
class TestGemma4Sdpa(_Gemma4):
    def llm_options(self) -> dict[str, Any]:
        return {"model_impl": "gemma4", "attention": {"backend": "sdpa"}}


@pytest.mark.slow
class TestGemma4Paged(_Gemma4):
    def llm_options(self) -> dict[str, Any]:
        return {"model_impl": "gemma4", "attention": {"backend": "paged"}}

    def llm(self, path, **overrides: Any) -> Any:
        if overrides.get("kvcache", {}).get("backend", "contiguous") == "contiguous":
            overrides["kvcache"] = {**overrides.get("kvcache", {}), "backend": "paged", "block_size": 16}
        return super().llm(path, **overrides)


def test_native_architecture_is_chosen():
    from lmplug.engine.architecture import choose_architecture
    from lmplug.plugins import get_registry

    info, reason = choose_architecture(K_EQ_V, "auto", "config.json", get_registry())
    assert info.name == "gemma4" and "gemma4_text" in reason


def _engine_kv(tmp_path, config, kvcache):
    from lmplug import LLM

    build_gemma4(config, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", max_model_len=64, kvcache=kvcache,
              scheduler={"max_num_seqs": 2})
    return llm.engine.parts.kv


@pytest.mark.parametrize("kvcache", [{"backend": "contiguous"},
                                     {"backend": "paged", "block_size": 4, "num_blocks": 10}])
def test_kv_cache_stores_each_layer_at_its_shape(tmp_path, kvcache):
    """Sliding layers 2 KV heads x 16, full layers 1 x 32: each layer's view has its own shape,
    and bytes per token count each layer's K and V (fp32) at its shape."""
    kv = _engine_kv(tmp_path, K_EQ_V, kvcache)
    shapes = [tuple(kv.layer_view(i).k_cache.shape[-2:]) for i in range(4)]
    assert shapes == [(2, 16), (1, 32), (2, 16), (1, 32)]
    assert [tuple(kv.layer_view(i).v_cache.shape[-2:]) for i in range(4)] == shapes
    assert kv.spec.bytes_per_token == 2 * 4 * (2 * (2 * 16) + 2 * (1 * 32))
    if kvcache["backend"] == "paged":
        assert kv.memory_bytes == 10 * 4 * kv.spec.bytes_per_token


def test_paged_copy_on_write_copies_every_group(tmp_path):
    """A block copy (prefix sharing, forks) reaches the pools of both layer shapes."""
    kv = _engine_kv(tmp_path, K_EQ_V, {"backend": "paged", "block_size": 4, "num_blocks": 10})
    for i in range(4):
        kv.layer_view(i).k_cache[3].fill_(float(i + 1))
    kv._copy_blocks([(3, 7)])
    for i in range(4):
        assert torch.all(kv.layer_view(i).k_cache[7] == float(i + 1))


def test_spec_rejects_layer_shapes_of_the_wrong_length():
    from lmplug.api import KVCacheSpec

    with pytest.raises(ValueError, match="layer_shapes lists 1 layers, num_layers is 2"):
        KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, device=torch.device("cpu"),
                    max_model_len=8, max_num_seqs=1, layer_shapes=((2, 16),))


@pytest.mark.parametrize("change, names", [
    ({"hidden_size_per_layer_input": 8}, ["hidden_size_per_layer_input", "per-layer embeddings"]),
    ({"num_kv_shared_layers": 2}, ["num_kv_shared_layers"]),
    ({"use_bidirectional_attention": "all"}, ["use_bidirectional_attention"]),
    ({"hidden_activation": "silu"}, ["hidden_activation", "silu"]),
    ({"per_layer_config": {"9": {"head_dim": 8}}}, ["per_layer_config", "'9'"]),
    ({"enable_moe_block": True, "num_experts": 2, "top_k_experts": 3, "moe_intermediate_size": 8},
     ["top_k_experts"]),
])
def test_bad_config_is_refused_naming_the_key(change, names):
    from lmplug_models.architectures import Gemma4Architecture

    from lmplug.errors import ModelLoadError

    with pytest.raises(ModelLoadError) as err:
        Gemma4Architecture(None).parse_config({**K_EQ_V, **change}, "config.json")
    for name in names:
        assert name in str(err.value)
