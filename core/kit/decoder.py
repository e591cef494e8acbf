"""The standard decoder an architecture builds on: attention, gated MLP, pre-norm layers and the
causal LM around them (Llama's shape; Mistral, Qwen2 and Qwen3 are flags of ``ModelConfig``).

An architecture subclasses ``DecoderForCausalLM`` and overrides what differs: ``make_attention``,
``make_mlp``, ``new_layer``, the checkpoint names (``STACKED``, ``weight_target``,
``checkpoint_name``). A layer asks its attention backend for attention and its linear layers'
quant method for matmuls; it does not know which ones it got.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from lmplug.interfaces.attention import AttentionBackend, KVLayerView
from lmplug.interfaces.model_config import ModelConfig
from lmplug.interfaces.quant import QuantMethod
from lmplug.interfaces.step import StepContext
from lmplug.kit import extras
from lmplug.kit.layers import Linear, RMSNorm, apply_rope, silu_and_mul
from lmplug.kit.native_step import LayerForm, NativeDecodeStep
from lmplug.kit.packed_embedding import QuantEmbedding
from lmplug.kit.parallel import ParallelState, single
from lmplug.kit.parallel_layers import column_linear, embedding, row_linear
from lmplug.kit.pipeline import foreign_layer, stage_input, stage_layers, stage_output
from lmplug.kit.rope import RotaryEmbedding


class Attention(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, quant: QuantMethod,
                 backend: AttentionBackend, tp: ParallelState | None = None) -> None:
        super().__init__()
        self.layer = layer
        # tensor parallel: this rank's query heads and KV heads (all of them on one process)
        tp = tp or single()
        first_kv, num_kv = tp.kv_heads(cfg.num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads // tp.world_size, num_kv, cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = num_kv * cfg.head_dim
        kv_start = first_kv * cfg.head_dim
        self.qkv_proj = column_linear(cfg.hidden_size, {"q_proj": (tp.rank * self.q_size, self.q_size),
                                                        "k_proj": (kv_start, self.kv_size),
                                                        "v_proj": (kv_start, self.kv_size)},
                                      bias=cfg.attention_bias, dtype=dtype, quant=quant, tp=tp)
        self.o_proj = row_linear(cfg.num_heads * cfg.head_dim, {"o_proj": cfg.hidden_size}, bias=cfg.o_bias,
                                 dtype=dtype, quant=quant, tp=tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.backend = backend

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                kv: KVLayerView, ctx: StepContext) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        # [T, H, D], [T, Hkv, D], [T, Hkv, D]: views, one split (ops per layer count at batch 1)
        q, k, v = qkv.view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim).split_with_sizes(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(rope, positions, q, k)  # fused path: in place, qkv is this layer's own
        out = self.backend.forward(self.layer, q, k, v, kv, ctx)  # [T, H, D]
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant: QuantMethod,
                 intermediate_size: int | None = None, tp: ParallelState | None = None) -> None:
        super().__init__()
        if cfg.hidden_act not in ("silu", "swish"):
            from lmplug.errors import ModelLoadError
            raise ModelLoadError(f"hidden_act {cfg.hidden_act!r} is not supported; supported: silu")
        inter = intermediate_size or cfg.intermediate_size  # MoE shared experts have their own width
        tp = tp or single()  # tensor parallel: gate/up split by columns, down by rows
        start, self.intermediate = tp.split(inter)
        self.gate_up_proj = column_linear(cfg.hidden_size, {"gate_proj": (start, self.intermediate),
                                                            "up_proj": (start, self.intermediate)},
                                          bias=cfg.mlp_bias, dtype=dtype, quant=quant, tp=tp)
        self.down_proj = row_linear(inter, {"down_proj": cfg.hidden_size},
                                    bias=cfg.mlp_bias, dtype=dtype, quant=quant, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))  # [T, 2I] -> [T, I] -> [T, h]


class DecoderLayer(torch.nn.Module):
    """Attention (``attn`` when given, e.g. MLA) then a feed-forward block: the dense ``MLP``, or
    ``mlp`` when given (an MoE block)."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, quant: QuantMethod,
                 backend: AttentionBackend, mlp: torch.nn.Module | None = None,
                 attn: torch.nn.Module | None = None, tp: ParallelState | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = attn if attn is not None else Attention(cfg, layer, dtype, quant, backend, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = mlp if mlp is not None else MLP(cfg, dtype, quant, tp=tp)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                kv: KVLayerView, ctx: StepContext) -> torch.Tensor:
        # h = x + attention (into the attention block's fresh output), then its norm: one fused op
        h, normed = self.post_attention_layernorm.add_forward(
            self.self_attn(self.input_layernorm(x), positions, rope, kv, ctx), x)
        return h.add_(self.mlp(normed))  # h is this layer's own tensor

    def native_form(self, rope: RotaryEmbedding) -> LayerForm | None:
        """This layer as the native decode step runs it (the model's ``rope``); None: a subclass,
        or blocks other than the kit's ``Attention`` and dense ``MLP``."""
        attn = self.self_attn
        if type(self) is not DecoderLayer or type(attn) is not Attention or type(self.mlp) is not MLP:
            return None
        return LayerForm("pre", (self.input_layernorm, self.post_attention_layernorm, None, None), attn, self.mlp,
                         qk_norm=None if attn.q_norm is None else "head", rope=rope)


class DecoderForCausalLM(torch.nn.Module):
    """Decoder over flattened tokens: ``forward(input_ids [T], positions [T]) -> hidden [T, h]``."""

    # lmplug embeddings: forward returns the final-norm hidden states, which pooling reads
    final_hidden_states = True
    # builds only its pipeline stage's layers (``parallel.stage``); an architecture whose layers
    # share caches or states across the split says False and is refused under pipeline parallelism
    pipeline_stages = True

    # checkpoint name (after "model.layers.N.") -> (module path in the layer, shard)
    STACKED: ClassVar[dict[str, tuple[str, str]]] = {
        "self_attn.q_proj": ("self_attn.qkv_proj", "q_proj"),
        "self_attn.k_proj": ("self_attn.qkv_proj", "k_proj"),
        "self_attn.v_proj": ("self_attn.qkv_proj", "v_proj"),
        "self_attn.o_proj": ("self_attn.o_proj", "o_proj"),
        "mlp.gate_proj": ("mlp.gate_up_proj", "gate_proj"),
        "mlp.up_proj": ("mlp.gate_up_proj", "up_proj"),
        "mlp.down_proj": ("mlp.down_proj", "down_proj"),
    }

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant: QuantMethod,
                 attention: AttentionBackend, max_model_len: int, *, parallel: ParallelState | None = None) -> None:
        """``parallel``: this rank's shard layout (heads, slices, experts; None: one process)."""
        super().__init__()
        self.config = cfg
        # tensor parallel: the vocabulary is split in rows (embedding and LM head)
        self.tp = parallel or single()
        # pipeline parallel: the embedding on the first stage (and the last, for a tied LM head),
        # this stage's layers, the final norm and LM head on the last stage
        stage = self.tp.stage
        check_stages(self, cfg)
        self.hidden_dtype = dtype  # of the hidden states a stage receives
        # a quant method that takes packed tables (GGUF) holds the embedding and LM head too;
        # tensor parallelism slices dense ones
        packed = extras.takes_packed(quant, torch.get_default_device()) and not self.tp.is_parallel
        self.embed_tokens = None
        if stage.first or (stage.last and cfg.tie_word_embeddings):
            self.embed_tokens = (QuantEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, quant) if packed else
                                 embedding(cfg.vocab_size, cfg.hidden_size, dtype, self.tp))
        vocab_rows = self.tp.vocab_range(cfg.vocab_size)[1]
        self.layers = stage_layers(stage, cfg.num_layers, lambda i: self.new_layer(i, dtype, quant, attention))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if stage.last else None
        if cfg.tie_word_embeddings or not stage.last:
            self.lm_head = None
        elif packed:
            self.lm_head = Linear(cfg.hidden_size, {"lm_head": vocab_rows}, bias=False, dtype=dtype,
                                  quant=quant)
        else:
            self.lm_head = torch.nn.Parameter(torch.empty(vocab_rows, cfg.hidden_size, dtype=dtype),
                                              requires_grad=False)
        self.rope = RotaryEmbedding(cfg.head_dim, max(max_model_len, cfg.max_position_embeddings),
                                    cfg.rope_theta, cfg.rope_scaling, dtype)
        self.kv_views: list[KVLayerView] = []
        # planned on the first forward, after loading (``native_step``): None until then, False: none
        self._native_step: NativeDecodeStep | bool | None = False if stage.split else None
        # ``allow_native_step``'s decision, which a drafter's own layers over this model's features
        # (an MTP module's, an EAGLE head's) follow too
        self.native_step_allowed = not stage.split

    def allow_native_step(self, allowed: bool) -> None:
        """The engine plan's ``cpu.native_step``: False keeps the Python layers for every step."""
        self.native_step_allowed = allowed and not self.tp.stage.split
        self._native_step = None if self.native_step_allowed else False

    def new_layer(self, index: int, dtype: torch.dtype, quant: QuantMethod, attention: AttentionBackend,
                  kv_layer: int | None = None) -> DecoderLayer:
        """Decoder layer ``index`` of this architecture (its feed-forward block as layer ``index``
        has it: dense or MoE), attending through cache layer ``kv_layer`` (default ``index``). A
        checkpoint's multi-token-prediction layers (``lmplug.kit.mtp``) are built with it too."""
        cfg = self.config
        kv_layer = index if kv_layer is None else kv_layer
        return DecoderLayer(cfg, kv_layer, dtype, quant, attention, self.make_mlp(cfg, index, dtype, quant),
                            self.make_attention(cfg, kv_layer, dtype, quant, attention), tp=self.tp)

    def make_mlp(self, cfg: ModelConfig, layer: int, dtype: torch.dtype,
                 quant: QuantMethod) -> torch.nn.Module | None:
        """The feed-forward block of ``layer``; None: the dense ``MLP``. MoE models override it."""
        return None

    def make_attention(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, quant: QuantMethod,
                       backend: AttentionBackend) -> torch.nn.Module | None:
        """The attention block of ``layer``; None: ``Attention``. DeepSeek-V2 overrides it (MLA)."""
        return None

    def bind_kv(self, views: list[KVLayerView]) -> None:
        self.kv_views = views

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor | None:
        """The final-norm hidden states; under pipeline parallelism, on the last stage only (the
        others send theirs on and return None)."""
        x = stage_input(self.tp, self.embed_tokens, input_ids, self.config.hidden_size, self.hidden_dtype)
        return stage_output(self.tp, self.run_layers(x, positions, ctx), self.norm)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, ctx: StepContext, views: list | None = None,
                   num_layers: int | None = None) -> torch.Tensor:
        """x [T, h] through the decoder layers: all of them over the model's cache, or the first
        ``num_layers`` over ``views`` (a layer-skip drafter's own cache); in one C call where the
        step fits the native step."""
        step = self._native_step
        if step is None:
            step = self._native_step = NativeDecodeStep.build(self) or False
        if step and step.fits(x, ctx):
            out = step.run(x, positions, ctx, views, num_layers)  # every layer in one C call (None: not this step)
            if out is not None:
                return out
        views = self.kv_views if views is None else views
        for layer, kv in zip(self.layers[:num_layers], views):
            x = layer(x, positions, self.rope, kv, ctx)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        if isinstance(head, Linear):  # a table the quant method holds (tied: the embedding's)
            logits = head.quant.apply(head, hidden)
        else:
            # [N, V] (tensor parallel: [N, V / N] per rank)
            logits = F.linear(hidden, head.weight if self.lm_head is None else head)
        if not self.tp.is_parallel:
            return logits
        full = self.tp.gather_last_dim(logits)  # rank 0: every rank's vocabulary slice; others: None
        return None if full is None else full[:, :self.config.vocab_size]

    def checkpoint_name(self, path: str, shard: str | None) -> str:
        """The checkpoint (HF) tensor name that fills parameter ``path`` (shard ``shard``):
        the inverse of ``weight_target``, for error messages."""
        if path.startswith("layers."):
            idx, _, tail = path[len("layers."):].partition(".")
            module, _, param = tail.rpartition(".")
            for hf_module, (target, target_shard) in self.STACKED.items():
                if target == module and target_shard == shard:
                    return f"model.layers.{idx}.{hf_module}.{param}"
            return f"model.layers.{idx}.{tail}"
        if path in ("embed_tokens.weight", "norm.weight"):
            return f"model.{path}"
        if path in ("lm_head", "lm_head.weight"):
            return "lm_head.weight"
        return path

    def skips_tensor(self, name: str) -> bool:
        """A tensor of a layer another pipeline stage holds (the loader never reads it)."""
        return foreign_layer(self.tp.stage, name, "model.layers.")

    def weight_target(self, name: str) -> tuple[str, str | None] | None:
        """Map a checkpoint (HF) tensor name to (parameter path, shard) or None to skip it.
        (The loader also takes (path, shard, expert) for stacked expert weights.)"""
        if name.startswith("mtp."):
            return None  # Qwen3-Next's multi-token-prediction module: the mtp drafter loads it
        if name.startswith("model.layers."):
            rest = name[len("model.layers."):]
            idx, _, tail = rest.partition(".")
            if idx.isdigit() and int(idx) >= self.config.num_layers:
                return None  # DeepSeek-V3 / GLM-4.5 multi-token-prediction layers: the mtp drafter's
            module, _, param = tail.rpartition(".")
            if module in self.STACKED:
                path, shard = self.STACKED[module]
                return f"layers.{idx}.{path}.{param}", shard
            if "rotary_emb" in module:
                return None
            return f"layers.{idx}.{tail}", None
        if name == "model.embed_tokens.weight":
            return "embed_tokens.weight", getattr(self.embed_tokens, "SHARD", None)
        if name == "model.norm.weight":
            return "norm.weight", None
        if name == "lm_head.weight":
            if isinstance(self.lm_head, Linear):
                return "lm_head.weight", "lm_head"
            return (None if self.lm_head is None else ("lm_head", None))
        return name, None


def check_stages(model: torch.nn.Module, cfg: ModelConfig) -> None:
    """Refuse a pipeline split the architecture cannot serve: its layers must each own their cache
    layer (no shared or state caches beside them) unless it says otherwise."""
    stage = model.tp.stage
    if not stage.split:
        return
    from lmplug.errors import ConfigError

    if not model.pipeline_stages or cfg.has_states or cfg.num_kv_layers != cfg.num_layers:
        raise ConfigError(f"parallel.pipeline_parallel_size={stage.num_stages}: {type(model).__name__} "
                          f"({cfg.model_type}) cannot be split into pipeline stages yet (its layers share "
                          "caches or keep states across the split); use pipeline_parallel_size 1")
