"""MoE pieces below the engine: config parsing per family, DeepSeek's MoE block against
transformers' modules, stacked-expert loading and its errors, the moe section's resolution."""

from __future__ import annotations

import pytest
import torch
from lmplug_moe.reference import ReferenceMoE
from support.hf_models import _BASE, build_hf_model, one_torch_thread  # noqa: F401

from lmplug import BackendOptions, ConfigError, ModelLoadError, RoutingConfig
from lmplug.engine.architecture import model_config_of
from lmplug.interfaces.model_config import ModelConfig
from lmplug.interfaces.quant import Unquantized
from lmplug.kit.moe import SparseMoeBlock

ATTN = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4, "vocab_size": 128,
        "intermediate_size": 256}


def parse(model_type: str, **cfg) -> ModelConfig:
    return model_config_of({"model_type": model_type, **ATTN, **cfg})


# -- config.json -> MoEConfig ---------------------------------------------------------------------------


def test_dense_models_have_no_moe():
    assert parse("llama").moe is None and parse("qwen2").moe is None


def test_mixtral_config():
    moe = parse("mixtral", num_local_experts=8, num_experts_per_tok=2).moe
    assert (moe.num_experts, moe.intermediate_size, moe.routing) == (8, 256, RoutingConfig(2, True))
    assert moe.sparse_layers == {0, 1, 2, 3} and moe.shared_intermediate_size == 0


def test_qwen2_moe_config():
    cfg = parse("qwen2_moe", num_experts=60, num_experts_per_tok=4, moe_intermediate_size=32,
                shared_expert_intermediate_size=128, decoder_sparse_step=2, mlp_only_layers=[3],
                sliding_window=32768, use_sliding_window=False)
    moe = cfg.moe
    assert moe.routing == RoutingConfig(4, renormalize=False)  # norm_topk_prob defaults to false
    assert moe.sparse_layers == {1} and moe.shared_intermediate_size == 128 and moe.shared_expert_gate
    assert cfg.attention_bias and not cfg.o_bias and cfg.sliding_window is None


def test_qwen3_moe_config():
    cfg = parse("qwen3_moe", num_experts=128, num_experts_per_tok=8, moe_intermediate_size=32,
                norm_topk_prob=True)
    assert cfg.qk_norm and not cfg.attention_bias
    assert cfg.moe.routing == RoutingConfig(8, renormalize=True) and cfg.moe.shared_intermediate_size == 0


def test_deepseek_configs():
    v3 = parse("deepseek_v3", n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=16,
               n_shared_experts=1, first_k_dense_replace=3, n_group=8, topk_group=4, norm_topk_prob=True,
               routed_scaling_factor=2.5, topk_method="noaux_tc", scoring_func="sigmoid").moe
    assert v3.routing == RoutingConfig(8, True, "sigmoid", 8, 4, "top2_sum", 2.5)
    assert v3.correction_bias and v3.sparse_layers == {3} and v3.shared_intermediate_size == 16
    v2 = parse("deepseek_v2", n_routed_experts=160, num_experts_per_tok=6, moe_intermediate_size=16,
               n_shared_experts=2, first_k_dense_replace=1, n_group=8, topk_group=3,
               topk_method="group_limited_greedy", routed_scaling_factor=16.0).moe
    assert v2.routing == RoutingConfig(6, False, "softmax", 8, 3, "max", 16.0)
    assert not v2.correction_bias and v2.sparse_layers == {1, 2, 3} and v2.shared_intermediate_size == 32
    lite = parse("deepseek_v2", n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=16,
                 n_group=1, topk_group=1, topk_method="greedy").moe
    assert lite.routing == RoutingConfig(6, False)
    with pytest.raises(ModelLoadError, match="topk_method 'magic'"):
        parse("deepseek_v2", n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=8,
              topk_method="magic")
    with pytest.raises(ModelLoadError, match="moe_intermediate_size"):
        parse("qwen3_moe", num_experts=8, num_experts_per_tok=2)


# -- DeepSeek's MoE block against transformers' -----------------------------------------------------


def _copy_from_hf(ours: SparseMoeBlock, hf) -> None:
    ours.gate.weight.copy_(hf.gate.weight)
    if ours.gate.e_score_correction_bias is not None:
        ours.gate.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
    ours.experts.w_gate_up.copy_(hf.experts.gate_up_proj)  # transformers stacks them as we do
    ours.experts.w_down.copy_(hf.experts.down_proj)
    shared = hf.shared_experts
    ours.shared_expert.gate_up_proj.weight.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
    ours.shared_expert.down_proj.weight.copy_(shared.down_proj.weight)


def _deepseek(version: str):
    transformers = pytest.importorskip("transformers")
    common = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3, "vocab_size": 128,
              "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 16,
              "num_experts_per_tok": 4, "n_shared_experts": 2, "first_k_dense_replace": 1, "n_group": 4,
              "topk_group": 2}
    if version == "v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as cls
        cfg = transformers.DeepseekV3Config(norm_topk_prob=True, routed_scaling_factor=2.5, **common)
    else:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe as cls
        cfg = transformers.DeepseekV2Config(topk_method="group_limited_greedy", routed_scaling_factor=16.0,
                                            norm_topk_prob=False, **common)
    return cfg, cls


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_deepseek_moe_block_matches_transformers(version):
    cfg, cls = _deepseek(version)
    hf = cls(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in list(hf.parameters()) + list(hf.buffers()):
            p.copy_(0.02 * torch.randn(p.shape, generator=g) if p.dim() == 1 else
                    torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        mc = model_config_of(cfg.to_dict())
        # dense below first_k_dense_replace; V3's multi-token-prediction layer (3) is an MoE one too
        mtp = cfg.to_dict().get("num_nextn_predict_layers", 0)
        assert mc.moe.sparse_layers == {1, 2, *range(3, 3 + mtp)}
        ours = SparseMoeBlock(mc, torch.float32, Unquantized(), ReferenceMoE(BackendOptions()))
        _copy_from_hf(ours, hf)
        x = torch.randn(2, 9, 64, generator=g)
        torch.testing.assert_close(ours(x.view(-1, 64)), hf(x).view(-1, 64), atol=1e-5, rtol=1e-5)


# -- loading and building ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("mixtral", **{**_BASE, "num_local_experts": 4, "num_experts_per_tok": 2})
    path = tmp_path_factory.mktemp("moe") / "mixtral"
    build_hf_model(cfg).save_pretrained(path)
    return path


def test_missing_expert_tensor_is_named_as_the_checkpoint_names_it(tiny_mixtral, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from lmplug import LLM

    broken = tmp_path / "broken"
    shutil.copytree(tiny_mixtral, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"1 tensors missing.*model\.layers\.1\.block_sparse_moe\."
                                             r"experts\.3\.w3\.weight"):
        LLM(str(broken), dtype="float32", device="cpu", max_model_len=64)


def test_moe_section_resolution(tiny_mixtral):
    from lmplug import LLM

    llm = LLM(str(tiny_mixtral), dtype="float32", device="cpu", max_model_len=64, moe="fused")
    assert llm.engine.resolved.backends["moe"].name == "fused"
    counts = llm.engine.parts.model.parameter_counts()
    per_expert = 3 * 64 * 128  # w1, w3, w2 of one expert
    assert counts[0] - counts[1] == 2 * (4 - 2) * per_expert  # 2 layers, 2 of 4 experts idle
    with pytest.raises(ConfigError, match="moe: .*'nope'"):
        LLM(str(tiny_mixtral), dtype="float32", device="cpu", max_model_len=64, moe="nope")
    with pytest.raises(ConfigError, match=r"moe\.block_m"):
        LLM(str(tiny_mixtral), dtype="float32", device="cpu", max_model_len=64,
            moe={"backend": "fused", "block_m": 24})


def test_a_dense_model_ignores_a_moe_section(tmp_path, caplog):
    from support.hf_models import get_model

    from lmplug import LLM

    tiny = get_model("llama", tmp_path)
    with caplog.at_level("WARNING", logger="lmplug.engine.build"):
        llm = LLM(str(tiny.path), dtype="float32", device="cpu", max_model_len=64, moe="reference")
    assert "moe: ignored, a llama model has no mixture-of-experts layers" in caplog.text
    assert "moe" not in llm.engine.resolved.backends


def test_bench_reports_total_and_active_parameters(tiny_mixtral, capsys):
    """`lmplug bench` on an MoE model prints total vs active parameters per token, counted here
    from the checkpoint itself: every tensor, minus the (E - k) idle experts of each layer."""
    import math

    from safetensors import safe_open

    from lmplug.cli import main

    with safe_open(str(tiny_mixtral / "model.safetensors"), "pt") as f:
        names = f.keys()
        total = sum(math.prod(f.get_slice(name).get_shape()) for name in names)
    idle = 2 * (4 - 2) * 3 * 64 * 128  # 2 layers x 2 idle experts x (w1, w3, w2)
    assert main(["bench", "--model", str(tiny_mixtral), "--dtype", "float32", "--device", "cpu",
                 "--prompt-tokens", "8", "--new-tokens", "4", "--repeats", "1"]) == 0
    line = f"parameters: {total / 1e6:,.2f} M total, {(total - idle) / 1e6:,.2f} M active per token (MoE)"
    assert line in capsys.readouterr().out
