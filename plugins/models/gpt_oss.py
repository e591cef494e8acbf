"""GPT-OSS: a pre-norm decoder whose attention has q/k/v/o biases and a learned sink logit per head
(``AttentionBackend.forward(..., sinks=)``), sliding-window layers between global ones (1:1,
``layer_types``), YaRN RoPE, and a mixture of experts in every layer: a router with a bias
(top-k of the logits, softmax over those k) and experts with biases whose SwiGLU is clamped
(``gate <= limit``, ``|up| <= limit``, ``(up + 1) * gate * sigmoid(alpha * gate)``), gate and up
interleaved in the checkpoint's ``gate_up_proj`` (gate at even columns).

Each expert's two projections are ``Linear`` holders of the model's quant method (MXFP4 keeps
the checkpoint's packed ``*_blocks`` / ``*_scales``; any other method, or none, its own weights),
so tensor parallelism splits an expert's width like a dense MLP's: the interleaved rows of the
rank's slice of the intermediate size are contiguous. The checkpoint's stacked tensors
(``experts.gate_up_proj [E, h, 2I]``, ``experts.down_proj [E, I, h]``, their ``_bias``, or the
MXFP4 ``_blocks [E, rows, in/32, 16]`` and ``_scales [E, rows, in/32]``) are split per expert at
load (``split_tensor``). llama.cpp's GGUF files (``gpt-oss``) keep gate and up apart
(``ffn_gate_exps``, ``ffn_up_exps`` ``[E, I, h]``, MXFP4 or float): they are interleaved again
once both of a layer have been read; quantized ones are read packed (``PACKED_SPLIT``) and stay
packed, interleaved as rows of blocks (the ``gguf`` method multiplies MXFP4 ones with the
``mxfp4`` method's kernels).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from lmplug_models.blocks import (
    FULL,
    SLIDING,
    AttentionShape,
    FlexAttention,
    FlexDecoder,
    FlexLayer,
    layer_kinds,
)

from lmplug.api import (
    ConfigReader,
    GGUFHeader,
    LayerAttention,
    ModelConfig,
    MoEBackend,
    PackedTensor,
    decoder_tensor_name,
)
from lmplug.errors import ModelLoadError
from lmplug.kit.parallel_layers import column_linear, row_linear
from lmplug.kit.sharding import RangeShard, tensor_shape

# the checkpoint's stacked expert tensors (dense, bias, MXFP4 blocks and scales)
_STACKED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?")
# the per-expert names ``split_tensor`` gives them
_PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)\.(\d+)\.(\w+)")
# a GGUF's experts, as ``gpt_oss_tensor_name`` names them: [E, out, in] weights, [E, out] biases
_GGUF_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)\.(weight|bias)")
_SHARD = {"gate_up_proj": "gate_up", "down_proj": "down"}
_GGUF_NAMES = {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks",
               "ffn_gate_inp": "mlp.router", "ffn_gate_exps": "mlp.experts.gate_proj",
               "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"}
MXFP4_BLOCK = 32  # values per MXFP4 block (one E8M0 scale each)


@dataclass(frozen=True)
class GptOssOptions:
    alpha: float  # swiglu_alpha
    limit: float  # swiglu_limit
    window: int | None
    kinds: tuple[str, ...]  # per layer: SLIDING or FULL


def gpt_oss_options(cfg: ModelConfig, where: str = "config.json") -> GptOssOptions:
    r = ConfigReader(cfg.raw, where)
    return GptOssOptions(alpha=r.number("swiglu_alpha", 1.702), limit=r.number("swiglu_limit", 7.0),
                         window=r.int("sliding_window", 128),
                         kinds=layer_kinds(cfg, lambda i: SLIDING if i % 2 == 0 else FULL))


def gpt_oss_gguf_config(header: GGUFHeader, config: dict) -> dict:
    """llama.cpp's ``gpt-oss`` metadata on top of the standard decoder's (``config``): experts, their
    width, the window; llama.cpp fixes the SwiGLU's alpha and limit (the defaults here) and its YaRN
    truncates the correction range (``truncate`` left at its default)."""
    return {**config, "num_local_experts": int(header.key("expert_count")),
            "num_experts_per_tok": int(header.key("expert_used_count")),
            "intermediate_size": int(header.key("expert_feed_forward_length", config["intermediate_size"])),
            "sliding_window": int(header.key("attention.sliding_window", 128)), "attention_bias": True}


def gpt_oss_tensor_name(gguf_name: str, where: str) -> str:
    """llama.cpp's GPT-OSS tensor names -> the HF ones (the experts' gate, up and down kept apart)."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_NAMES:
        name = f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}"
        return name if parts[2] == "attn_sinks" else f"{name}.{parts[3]}"
    return decoder_tensor_name(gguf_name, where)


def gpt_oss_layers(cfg: ModelConfig) -> tuple[LayerAttention, ...]:
    """Every layer with sinks; the sliding ones with the window."""
    opts = gpt_oss_options(cfg)
    return tuple(LayerAttention(cfg.head_dim ** -0.5, opts.window if kind == SLIDING else None, sinks=True)
                 for kind in opts.kinds)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[n, 2I] interleaved (gate at even columns, up at odd) -> [n, I]."""
    gate, up = gate_up[:, ::2].clamp(max=limit), gate_up[:, 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@dataclass(frozen=True)
class _PackedExperts:
    """A GGUF's packed ``[E * out, in]`` expert weight, indexed by expert like a stacked tensor."""

    packed: PackedTensor
    experts: int

    def __getitem__(self, e: int) -> PackedTensor:
        rows = self.packed.shape[0] // self.experts
        return self.packed.rows(slice(e * rows, (e + 1) * rows))


def _interleave_packed(gate, up, e: int) -> PackedTensor:
    """Expert ``e``'s gate and up rows interleaved (gate at even rows), as packed bytes; both
    packed and of one type (a copy of the blocks, never a float one)."""
    g, u = gate[e], up[e]
    if not isinstance(g, PackedTensor) or not isinstance(u, PackedTensor) or g.ggml_type != u.ggml_type:
        raise ValueError("has gate and up experts of different types; they are interleaved into one "
                         "gate_up_proj, so both must be packed of one ggml type")
    data = torch.stack([g.data, u.data], dim=1).flatten(0, 1)
    return PackedTensor(data, g.ggml_type, (data.shape[0], g.shape[1]), g.name)


class GptOssAttention(FlexAttention, RangeShard):
    """The kit's attention block (q/k/v/o biases, YaRN RoPE) with its heads' sink logits."""

    def __init__(self, cfg, layer, dtype, quant, backend, tp, shape) -> None:
        super().__init__(cfg, layer, dtype, quant, backend, tp, shape)
        self.sinks = torch.nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.tp_ranges = {"sinks": ((tp.rank * self.num_heads, self.num_heads),)}  # this rank's heads


class Router(torch.nn.Module):
    def __init__(self, hidden: int, experts: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(experts, hidden, dtype=dtype), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(experts, dtype=dtype), requires_grad=False)


class GptOssMoE(torch.nn.Module):
    """Router + experts: x [T, h] -> [T, h]. Routed by the moe backend (softmax top-k, which is
    GPT-OSS's softmax over the top-k logits); the experts run here, one quant-method product per
    expert hit (their biases and clamped SwiGLU are no moe backend's ``experts``). Tensor
    parallel: every rank a slice of each expert's width, the routed sum all-reduced once."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant, backend: MoEBackend, tp, alpha: float,
                 limit: float) -> None:
        super().__init__()
        moe = cfg.moe
        if tp.is_parallel and tp.expert_parallel:
            raise ModelLoadError("gpt_oss: expert parallelism is not supported (its experts are split by width "
                                 "under tensor parallelism); set `parallel.expert_parallel: false`")
        self.routing, self.backend, self.tp = moe.routing, backend, tp
        self.alpha, self.limit = alpha, limit
        self.router = Router(cfg.hidden_size, moe.num_experts, dtype)
        start, local = tp.split(moe.intermediate_size)
        self.gate_up_proj = torch.nn.ModuleList(
            column_linear(cfg.hidden_size, {"gate_up": (2 * start, 2 * local)}, bias=True, dtype=dtype,
                          quant=quant, tp=tp) for _ in range(moe.num_experts))
        self.down_proj = torch.nn.ModuleList(
            row_linear(moe.intermediate_size, {"down": cfg.hidden_size}, bias=True, dtype=dtype, quant=quant,
                       tp=tp) for _ in range(moe.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.router.weight, self.router.bias)  # [T, E]
        ids, weights = self.backend.route(logits, self.routing)  # [T, k]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in ids.unique().tolist():
            tokens, slots = (ids == e).nonzero(as_tuple=True)
            up, down = self.gate_up_proj[e], self.down_proj[e]
            hidden = clamped_swiglu(up.quant.apply(up, x[tokens]), self.alpha, self.limit)
            y = down.quant.apply(down, hidden.to(x.dtype))  # the rank's partial sum (bias on rank 0)
            out.index_add_(0, tokens, y.float() * weights[tokens, slots, None])
        return self.tp.all_reduce(out.to(x.dtype))


class GptOssForCausalLM(FlexDecoder):
    """GPT-OSS (``model_type`` gpt_oss)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant, attention, max_model_len: int, *,
                 moe: MoEBackend | None = None, parallel=None) -> None:
        if cfg.moe is None or moe is None:
            raise ModelLoadError("gpt_oss: the model needs its MoE configuration and an moe backend")
        self._options, self._moe_backend = gpt_oss_options(cfg), moe
        self._gguf_pending: dict[tuple[str, str, str], torch.Tensor] = {}  # a GGUF's gate or up, awaiting the other
        super().__init__(cfg, dtype, quant, attention, max_model_len, parallel=parallel)

    PACKED_SPLIT = True  # split_tensor keeps a GGUF's packed experts packed (``_split_gguf``)

    def new_layer(self, index, dtype, quant, attention, kv_layer=None):
        cfg, opts = self.config, self._options
        attn = GptOssAttention(cfg, index if kv_layer is None else kv_layer, dtype, quant, attention, self.tp,
                               AttentionShape(self.layer_rope()))
        mlp = GptOssMoE(cfg, dtype, quant, self._moe_backend, self.tp, opts.alpha, opts.limit)
        return FlexLayer(cfg, attn, mlp, dtype, "pre")

    def split_tensor(self, name: str, tensor) -> list[tuple[str, torch.Tensor]]:
        """A stacked expert tensor -> one tensor per expert, named ``...experts.{proj}.{e}.{weight|
        bias|blocks|scales}``; the dense weights transposed to ``[out, in]``. ValueError (the loader
        names the tensor) for a stacked tensor of the wrong shape, e.g. an MXFP4 tensor whose block
        count does not cover the input features."""
        match = _STACKED.fullmatch(name)
        if match is None:
            gguf = _GGUF_EXPERTS.fullmatch(name)
            return [(name, tensor)] if gguf is None else self._split_gguf(*gguf.groups(), tensor)
        layer, proj, kind = match[1], match[2], match[3] or ""
        moe, hidden = self.config.moe, self.config.hidden_size
        rows, cols = (2 * moe.intermediate_size, hidden) if proj == "gate_up_proj" else (hidden, moe.intermediate_size)
        groups = cols // MXFP4_BLOCK
        want = {"": (moe.num_experts, cols, rows), "_bias": (moe.num_experts, rows),
                "_blocks": (moe.num_experts, rows, groups, MXFP4_BLOCK // 2),
                "_scales": (moe.num_experts, rows, groups)}[kind]
        shape = tensor_shape(tensor)
        if kind in ("_blocks", "_scales") and cols % MXFP4_BLOCK:
            raise ValueError(f"is MXFP4, whose blocks of {MXFP4_BLOCK} must cover the {cols} input features; "
                             f"{cols} is not a multiple of {MXFP4_BLOCK}")
        if shape != want:
            what = {"": "[experts, in, out]", "_bias": "[experts, out]",
                    "_blocks": f"[experts, out, in / {MXFP4_BLOCK} blocks, {MXFP4_BLOCK // 2} bytes]",
                    "_scales": f"[experts, out, in / {MXFP4_BLOCK} blocks]"}[kind]
            blocks = (f" ({shape[2] if len(shape) > 2 else '?'} blocks a row where {groups} cover the {cols} "
                      "input features)" if kind in ("_blocks", "_scales") else "")
            raise ValueError(f"has shape {shape}, the model expects {want} {what}{blocks}")
        holder = self.layers[int(layer)].mlp.gate_up_proj[0] if int(layer) < len(self.layers) else None
        if kind == "" and holder is not None and "blocks" in holder._parameters:
            raise ValueError(f"holds float experts, but quant method {holder.quant.name!r} reads MXFP4 checkpoints "
                             "only (`*_blocks` and `*_scales`); drop the `quant` section for this checkpoint")
        suffix = {"": "weight", "_bias": "bias", "_blocks": "blocks", "_scales": "scales"}[kind]
        prefix = f"model.layers.{layer}.mlp.experts.{proj}"
        return [(f"{prefix}.{e}.{suffix}", tensor[e].t() if kind == "" else tensor[e])
                for e in range(moe.num_experts)]

    def _split_gguf(self, layer: str, proj: str, kind: str, tensor) -> list[tuple[str, torch.Tensor]]:
        """A GGUF's ``[E, out, in]`` expert weights or ``[E, out]`` biases -> per-expert tensors; gate
        and up wait for each other, then go out interleaved (gate at even rows) as ``gate_up_proj``.
        Packed weights (``PackedTensor``, ``[E * out, in]``, read with ``PACKED_SPLIT``) stay packed:
        rows of whole blocks, interleaved as bytes."""
        moe, hidden = self.config.moe, self.config.hidden_size
        rows, cols = (hidden, moe.intermediate_size) if proj == "down_proj" else (moe.intermediate_size, hidden)
        packed = isinstance(tensor, PackedTensor)
        if packed and kind != "weight":  # a float bias read as a 2-D packed tensor
            tensor, packed = tensor.dequantize(), False
        want = (moe.num_experts, rows, cols) if kind == "weight" else (moe.num_experts, rows)
        shape = (moe.num_experts * rows, cols) if packed else want
        if tuple(tensor.shape) != shape:
            what = "[experts * out, in] packed rows" if packed else "[experts, out, in]" if kind == "weight" \
                else "[experts, out]"
            raise ValueError(f"has shape {tuple(tensor.shape)}, the model expects {shape} ({what})")
        if packed:
            tensor.check()
            tensor = _PackedExperts(tensor, moe.num_experts)
        prefix = f"model.layers.{layer}.mlp.experts"
        if proj == "down_proj":
            return [(f"{prefix}.down_proj.{e}.{kind}", tensor[e]) for e in range(moe.num_experts)]
        other = "up_proj" if proj == "gate_proj" else "gate_proj"
        partner = self._gguf_pending.pop((layer, other, kind), None)
        if partner is None:
            self._gguf_pending[layer, proj, kind] = tensor
            return []
        gate, up = (tensor, partner) if proj == "gate_proj" else (partner, tensor)
        if packed or isinstance(partner, _PackedExperts):
            return [(f"{prefix}.gate_up_proj.{e}.{kind}", _interleave_packed(gate, up, e))
                    for e in range(moe.num_experts)]
        both = torch.stack([gate, up], dim=2).flatten(1, 2)  # [E, 2I(, h)]: gate, up, gate, up, ...
        return [(f"{prefix}.gate_up_proj.{e}.{kind}", both[e]) for e in range(moe.num_experts)]

    def weight_target(self, name: str):
        match = _PER_EXPERT.fullmatch(name)
        if match is None:
            return super().weight_target(name)
        layer, proj, expert, tensor = match.groups()
        return f"layers.{layer}.mlp.{proj}.{expert}.{tensor}", _SHARD[proj]

    def checkpoint_name(self, path: str, shard: str | None) -> str:
        if ".mlp.gate_up_proj." in path or ".mlp.down_proj." in path:  # an expert's holder
            return "model." + path.replace(".mlp.", ".mlp.experts.")
        return super().checkpoint_name(path, shard)
