"""The first-party architectures as ``Architecture`` backends of the ``model`` family.

Each one declares the ``config.json`` model types it serves, reads their configs (what each model
type implies: Qwen2's q/k/v biases, Qwen3's q/k norms, an MoE family's expert keys, the hybrids'
layer kinds; ``ModelConfig.from_hf`` reads the rest) and llama.cpp's GGUF files where it declares
them, and builds its module (``lmplug_models.llama`` etc.); ``lmplug_models.plugin`` registers
them through the entry-point group ``lmplug.plugins``, as a third-party architecture package would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from functools import partial
from typing import Any, ClassVar

import torch
from lmplug_models import gguf_configs
from lmplug_models.deepseek_v2 import DeepseekV2ForCausalLM
from lmplug_models.diffusion_gemma import (
    DiffusionGemmaForBlockDiffusion,
    diffusion_layers,
    diffusion_text_config,
)
from lmplug_models.gemma import GemmaForCausalLM, gemma_layers, gemma_options
from lmplug_models.gemma4 import Gemma4ForCausalLM, gemma4_layers, gemma4_options
from lmplug_models.gpt_oss import (
    GptOssForCausalLM,
    gpt_oss_gguf_config,
    gpt_oss_layers,
    gpt_oss_options,
    gpt_oss_tensor_name,
)
from lmplug_models.llama import LlamaForCausalLM
from lmplug_models.mamba2 import Mamba2ForCausalLM
from lmplug_models.minimax import MiniMaxForCausalLM
from lmplug_models.moe import MoEForCausalLM
from lmplug_models.phi3 import Phi3ForCausalLM, check_longrope
from lmplug_models.qwen3_next import Qwen3NextForCausalLM
from lmplug_models.small_families import (
    GraniteForCausalLM,
    Olmo2ForCausalLM,
    SmolLM3ForCausalLM,
    granite_multipliers,
    smollm3_layers,
    smollm3_ropes,
)

from lmplug.api import (
    GATED_DELTA,
    GGUF,
    LIGHTNING,
    MAMBA2,
    MLA,
    MTP,
    PACKED_WEIGHTS,
    STATE_LAYERS,
    TENSOR_PARALLEL,
    Architecture,
    CacheLayout,
    Capabilities,
    ConfigReader,
    GGUFHeader,
    ModelConfig,
    check_depth,
    decoder_config,
    decoder_tensor_name,
    deepseek_moe,
    hybrid_layer_types,
    mamba2_fields,
    mixtral_moe,
    qwen_moe,
)

NATIVE_PRIORITY = 10  # above any fallback (priority 0)
_ANY = frozenset({"cpu", "cuda"})


def _caps(*features: str) -> Capabilities:
    return Capabilities(devices=_ANY, features=frozenset(features), priority=NATIVE_PRIORITY)


# what a model type implies beyond the standard decoder keys (``ModelConfig.from_hf``'s facts)
_Facts = Mapping[str, Mapping[str, Any]]  # model_type -> its facts
_QWEN2 = {"qkv_bias": True, "window_flag": True}  # q/k/v biases; a window only with use_sliding_window
_QWEN3 = {"qk_norm": True, "window_flag": True}  # RMSNorm over each head of q and k


class _Native(Architecture):
    """An architecture whose module is one of lmplug's own model classes."""

    module: ClassVar[type[torch.nn.Module]]
    # model_type -> its facts (``ModelConfig.from_hf`` keywords); a type not listed: none
    facts: ClassVar[_Facts] = {}

    def parse_config(self, hf_config: Mapping[str, Any], where: str) -> ModelConfig:
        return ModelConfig.from_hf(dict(hf_config), where, **self.facts.get(hf_config.get("model_type"), {}))

    def build(self, model_config: ModelConfig, *, dtype: Any, quant: Any, attention: Any,
              max_model_len: int, parallel: Any, moe: Any = None, mixer: Any = None) -> torch.nn.Module:
        extra = {name: backend for name, backend in (("moe", moe), ("mixer", mixer)) if backend is not None}
        return self.module(model_config, dtype, quant, attention, max_model_len, parallel=parallel, **extra)


class LlamaArchitecture(_Native):
    """Llama 2/3, Mistral (sliding window), Qwen2 (q/k/v biases), Qwen3 (q/k norms)."""

    name = "llama"
    module = LlamaForCausalLM
    model_types = ("llama", "mistral", "qwen2", "qwen3")
    facts: ClassVar[_Facts] = {"qwen2": _QWEN2, "qwen3": _QWEN3}
    gguf_architectures = ("llama", "qwen2", "qwen3")
    # llama.cpp permutes Q/K rows for models whose HF code uses rotate-half RoPE but whose GGUF
    # graph uses interleaved RoPE (llama); Qwen runs NEOX-style RoPE natively
    gguf_permuted = frozenset({"llama"})
    capabilities = _caps(TENSOR_PARALLEL, GGUF, PACKED_WEIGHTS, MTP)

    _HF_CLASS: ClassVar[dict[str, str]] = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                           "qwen3": "Qwen3ForCausalLM"}

    @classmethod
    def gguf_config(cls, header: GGUFHeader) -> dict[str, Any]:
        config = decoder_config(header, cls._HF_CLASS[header.arch])
        if header.arch in ("llama", "qwen3"):  # Qwen2's q/k/v biases are implied by its type
            config["attention_bias"] = "blk.0.attn_q.bias" in header.tensors
        if header.arch == "llama":
            config["mlp_bias"] = False
        return config


class MoEArchitecture(_Native):
    """Mixtral, Qwen2-MoE (shared expert), Qwen3-MoE."""

    name = "moe"
    module = MoEForCausalLM
    model_types = ("mixtral", "qwen2_moe", "qwen3_moe")
    facts: ClassVar[_Facts] = {"mixtral": {"moe": mixtral_moe},
                               "qwen2_moe": {**_QWEN2, "moe": partial(qwen_moe, gated_shared=True)},
                               "qwen3_moe": {**_QWEN3, "moe": qwen_moe}}
    capabilities = _caps(TENSOR_PARALLEL, MTP)


class DeepseekV2Architecture(_Native):
    """DeepSeek-V2/V3: multi-head latent attention and routed + shared experts."""

    name = "deepseek_v2"
    module = DeepseekV2ForCausalLM
    model_types = ("deepseek_v2", "deepseek_v3")
    # MLA has no KV heads to group
    facts: ClassVar[_Facts] = {
        "deepseek_v2": {"grouped_kv": False, "mla": True, "moe": deepseek_moe},
        "deepseek_v3": {"grouped_kv": False, "mla": True, "moe": partial(deepseek_moe, v3=True)}}
    capabilities = _caps(TENSOR_PARALLEL, MLA, MTP)


class Mamba2Architecture(_Native):
    """Mamba2: a pure state-space model."""

    name = "mamba2"
    module = Mamba2ForCausalLM
    model_types = ("mamba2",)
    capabilities = _caps(TENSOR_PARALLEL, STATE_LAYERS)

    def parse_config(self, hf_config: Mapping[str, Any], where: str) -> ModelConfig:
        """No attention: heads are the SSM's (``mamba2_fields``), every layer a Mamba2 mixer."""
        cfg = dict(hf_config)
        r = ConfigReader(cfg, where)
        check_depth(cfg, where)
        num_layers = r.int("num_hidden_layers")
        return ModelConfig(model_type="mamba2", vocab_size=r.int("vocab_size"), num_layers=num_layers,
                           tie_word_embeddings=r.flag("tie_word_embeddings", False),
                           hidden_act=r.text("hidden_act", "silu"), layer_types=(MAMBA2,) * num_layers,
                           raw=cfg, **mamba2_fields(r))


class MiniMaxArchitecture(_Native):
    """MiniMax-Text: lightning attention layers between softmax ones, MoE."""

    name = "minimax"
    module = MiniMaxForCausalLM
    model_types = ("minimax",)
    # Mixtral's block_sparse_moe in every layer; "linear_attention" layers are lightning attention
    facts: ClassVar[_Facts] = {
        "minimax": {"moe": mixtral_moe,
                    "layer_types": partial(hybrid_layer_types, linear=LIGHTNING, attn_type_list=True)}}
    capabilities = _caps(TENSOR_PARALLEL, STATE_LAYERS)


class Qwen3NextArchitecture(_Native):
    """Qwen3-Next: gated DeltaNet layers between gated softmax ones, MoE, an MTP module."""

    name = "qwen3_next"
    module = Qwen3NextForCausalLM
    model_types = ("qwen3_next",)
    # gated DeltaNet layers, every full_attention_interval-th (default 4) one softmax attention
    facts: ClassVar[_Facts] = {
        "qwen3_next": {"moe": partial(qwen_moe, gated_shared=True),
                       "layer_types": partial(hybrid_layer_types, linear=GATED_DELTA, interval=4)}}
    capabilities = _caps(TENSOR_PARALLEL, STATE_LAYERS, MTP)


def _parsed(hf_config: Mapping[str, Any], where: str, tied: bool = False, **changes: Any) -> ModelConfig:
    """The contract's ``ModelConfig`` of a kit-built family, with what the family reads otherwise:
    ``tied``, the default of ``tie_word_embeddings`` where its transformers config defaults to it."""
    config = ModelConfig.from_hf(dict(hf_config), where)
    if tied and "tie_word_embeddings" not in hf_config:
        changes["tie_word_embeddings"] = True
    return dataclasses.replace(config, **changes) if changes else config


def _gemma_parsed(hf_config: Mapping[str, Any], where: str, read_options) -> ModelConfig:
    """A Gemma family's ``ModelConfig``: tied embeddings by default, no model-wide window (each
    layer's is its ``LayerAttention``'s), the activation its options read (``read_options``)."""
    config = _parsed(hf_config, where, tied=True, sliding_window=None)
    return dataclasses.replace(config, hidden_act=read_options(config, where).activation)


def _shaped_layout(shapes: tuple[tuple[int, int], ...], layers: tuple) -> CacheLayout:
    """Attention scale 1.0 (Gemma 4's q/k norms), each layer's (KV heads, head_dim) where they differ."""
    return CacheLayout(*shapes[0], 1.0, layers=layers, layer_shapes=shapes if len(set(shapes)) > 1 else ())


class GemmaArchitecture(_Native):
    """Gemma 2 (soft-caps, 1:1 sliding / global layers) and Gemma 3 text (q/k norms, 5:1, two RoPE
    thetas). The window lives in each layer's attention (``LayerAttention``), not the model's: the KV
    cache keeps every block (the global layers read them all)."""

    name = "gemma"
    module = GemmaForCausalLM
    model_types = ("gemma2", "gemma3_text")
    gguf_architectures = ("gemma2", "gemma3")
    capabilities = _caps(TENSOR_PARALLEL, GGUF, PACKED_WEIGHTS)
    gguf_config = staticmethod(gguf_configs.gemma_config)

    @classmethod
    def gguf_tensor_name(cls, gguf_name: str, where: str) -> str:
        return decoder_tensor_name(gguf_name, where, gguf_configs.GEMMA_NAMES)

    @classmethod
    def gguf_values(cls, gguf_name: str, values: Any) -> Any:
        """llama.cpp's converter stores Gemma's norm weights as ``1 + w``; the checkpoint's are ``w``."""
        return values - 1.0 if gguf_name.endswith("norm.weight") else values

    def parse_config(self, hf_config: Mapping[str, Any], where: str) -> ModelConfig:
        return _gemma_parsed(hf_config, where, gemma_options)

    def cache_layout(self, model_config: ModelConfig) -> CacheLayout:
        layers = gemma_layers(model_config)
        return dataclasses.replace(super().cache_layout(model_config), scale=layers[0].scale, layers=layers)


class Gemma4Architecture(_Native):
    """Gemma 4 text, dense and MoE: sliding and full layers of different head sizes and KV heads,
    so the KV cache stores each layer at its own shape (``CacheLayout.layer_shapes``). One
    process (no tensor parallelism yet)."""

    name = "gemma4"
    module = Gemma4ForCausalLM
    model_types = ("gemma4_text",)
    capabilities = _caps()

    def parse_config(self, hf_config: Mapping[str, Any], where: str) -> ModelConfig:
        return _gemma_parsed(hf_config, where, gemma4_options)

    def cache_layout(self, model_config: ModelConfig) -> CacheLayout:
        opts = gemma4_options(model_config)
        return _shaped_layout(opts.shapes, gemma4_layers(opts))


class DiffusionGemmaArchitecture(_Native):
    """DiffusionGemma (block diffusion): a Gemma 4 MoE backbone run as a causal encoder, the only
    writer of the KV cache, and a bidirectional denoising decoder over each canvas; generation is
    the ``lmplug.diffusion`` select stage's. Text only (the vision tower is not loaded)."""

    name = "diffusion_gemma"
    module = DiffusionGemmaForBlockDiffusion
    model_types = ("diffusion_gemma",)
    capabilities = _caps()

    def parse_config(self, hf_config: Mapping[str, Any], where: str) -> ModelConfig:
        return _gemma_parsed(diffusion_text_config(dict(hf_config), where), where, gemma4_options)

    def cache_layout(self, model_config: ModelConfig) -> CacheLayout:
        return _shaped_layout(gemma4_options(model_config).shapes, diffusion_layers(model_config))


class SmolLM3Architecture(_Native):
    """SmolLM3: Llama with no RoPE in every fourth layer (``no_rope_layers``)."""

    name = "smollm3"
    module = SmolLM3ForCausalLM
    model_types = ("smollm3",)
    gguf_architectures = ("smollm3",)
    gguf_permuted = frozenset({"smollm3"})  # converted as Llama (rotate-half rows interleaved)
    capabilities = _caps(TENSOR_PARALLEL, GGUF, PACKED_WEIGHTS)
    gguf_config = staticmethod(gguf_configs.smollm3_config)

    def parse_config(self, hf_config: Mapping[str, Any], where: str) -> ModelConfig:
        config = _parsed(hf_config, where, tied=True, sliding_window=None)
        smollm3_ropes(config, where)
        return config

    def cache_layout(self, model_config: ModelConfig) -> CacheLayout:
        return dataclasses.replace(super().cache_layout(model_config), layers=smollm3_layers(model_config))


class Olmo2Architecture(_Native):
    """OLMo 2: norms after each block, q/k norms over all heads (one process: the norm spans every
    head, which tensor parallelism splits)."""

    name = "olmo2"
    module = Olmo2ForCausalLM
    model_types = ("olmo2",)
    gguf_architectures = ("olmo2",)
    capabilities = _caps(GGUF, PACKED_WEIGHTS)
    gguf_config = staticmethod(gguf_configs.olmo2_config)

    @classmethod
    def gguf_tensor_name(cls, gguf_name: str, where: str) -> str:
        return decoder_tensor_name(gguf_name, where, gguf_configs.OLMO2_NAMES)


class GraniteArchitecture(_Native):
    """Granite 3: the embedding, residual, attention and logit multipliers of its config."""

    name = "granite"
    module = GraniteForCausalLM
    model_types = ("granite",)
    gguf_architectures = ("granite",)
    gguf_permuted = frozenset({"granite"})  # converted as Llama
    capabilities = _caps(TENSOR_PARALLEL, GGUF, PACKED_WEIGHTS)
    gguf_config = staticmethod(gguf_configs.granite_config)

    def parse_config(self, hf_config: Mapping[str, Any], where: str) -> ModelConfig:
        config = _parsed(hf_config, where)
        granite_multipliers(config, where)
        return config

    def cache_layout(self, model_config: ModelConfig) -> CacheLayout:
        scale = granite_multipliers(model_config)["attention"]
        return dataclasses.replace(super().cache_layout(model_config), scale=scale)


class Phi3Architecture(_Native):
    """Phi-3 / Phi-3.5 / Phi-4-mini: fused qkv and gate/up tensors kept fused (one process),
    LongRoPE, partial rotary."""

    name = "phi3"
    module = Phi3ForCausalLM
    model_types = ("phi3",)
    gguf_architectures = ("phi3",)
    capabilities = _caps(GGUF, PACKED_WEIGHTS)
    gguf_config = staticmethod(gguf_configs.phi3_config)

    @classmethod
    def gguf_tensor_name(cls, gguf_name: str, where: str) -> str | None:
        """The fused ``attn_qkv`` / ``ffn_up`` are HF's ``qkv_proj`` / ``gate_up_proj``; the LongRoPE
        factor tensors are settings (``gguf_config`` reads them)."""
        if gguf_name in gguf_configs.PHI3_ROPE_FACTORS:
            return None
        return decoder_tensor_name(gguf_name, where, gguf_configs.PHI3_NAMES)

    def parse_config(self, hf_config: Mapping[str, Any], where: str) -> ModelConfig:
        config = _parsed(hf_config, where)
        check_longrope(config, where)
        return config


class GptOssArchitecture(_Native):
    """GPT-OSS: attention sinks, 1:1 sliding / global layers, biases, YaRN, MoE with router and
    expert biases and a clamped SwiGLU; MXFP4 experts through the ``mxfp4`` quant method. The
    window lives in each layer's attention, as Gemma's."""

    name = "gpt_oss"
    module = GptOssForCausalLM
    model_types = ("gpt_oss",)
    gguf_architectures = ("gpt-oss",)
    capabilities = _caps(TENSOR_PARALLEL, GGUF)

    @classmethod
    def gguf_config(cls, header: GGUFHeader) -> dict[str, Any]:
        return gpt_oss_gguf_config(header, decoder_config(header, "GptOssForCausalLM", "gpt_oss"))

    @classmethod
    def gguf_tensor_name(cls, gguf_name: str, where: str) -> str:
        return gpt_oss_tensor_name(gguf_name, where)

    def parse_config(self, hf_config: Mapping[str, Any], where: str) -> ModelConfig:
        # Mixtral's expert keys (num_local_experts, intermediate_size, num_experts_per_tok; softmax top-k)
        config = ModelConfig.from_hf(dict(hf_config), where, moe=mixtral_moe)
        config = dataclasses.replace(config, sliding_window=None)
        gpt_oss_options(config, where)
        return config

    def cache_layout(self, model_config: ModelConfig) -> CacheLayout:
        return dataclasses.replace(super().cache_layout(model_config), layers=gpt_oss_layers(model_config))


FIRST_PARTY: tuple[type[Architecture], ...] = (
    LlamaArchitecture, MoEArchitecture, DeepseekV2Architecture, Mamba2Architecture,
    MiniMaxArchitecture, Qwen3NextArchitecture, GemmaArchitecture, Gemma4Architecture,
    DiffusionGemmaArchitecture, SmolLM3Architecture, Olmo2Architecture, GraniteArchitecture, Phi3Architecture,
    GptOssArchitecture,
)
