"""Hybrid decoders: softmax-attention layers interleaved with state layers (MiniMax, Qwen3-Next).

``ModelConfig.layer_types`` says what each layer's sequence mixer is. An attention layer is the
Llama family's (its K/V in cache layer ``cache_indices[i]``); a state layer's mixer (lightning
attention, gated DeltaNet) comes from the architecture's ``make_state_mixer`` and keeps its
per-sequence state in state layer ``cache_indices[i]`` of the KV cache's state pool. Both sit in
the same ``DecoderLayer`` slot (``self_attn``) and take the same call,
``mixer(x, positions, rope, cache, ctx)``, where ``cache`` is the layer's ``KVLayerView`` or its
state pools (``{name: [num_slots, ...]}``); the feed-forward blocks (dense or MoE) are the MoE
decoder's.

Tensor parallelism: every rank holds its heads' state in its own pool, but only rank 0's KV cache
hands out slots (zeroing each one it takes); the other ranks see the slots in the step's context.
So under tensor parallelism each rank zeroes the slots of the sequences a step starts
(``state_layers.zero_fresh_states``); on one process nothing is added to a step.
"""

from __future__ import annotations

import torch
from lmplug_models.moe import MoEForCausalLM

from lmplug.api import (
    ATTENTION,
    AttentionBackend,
    MixerBackend,
    ModelConfig,
    MoEBackend,
    QuantMethod,
    StateSpec,
    StepContext,
    cache_indices,
)
from lmplug.errors import ModelLoadError
from lmplug.kit.parallel import ParallelState
from lmplug.kit.state_layers import zero_fresh_states


class HybridForCausalLM(MoEForCausalLM):
    """The MoE decoder whose layers' mixers follow ``cfg.layer_types``. Subclasses build their
    state mixers (``make_state_mixer``); a state mixer module has ``state_tensors(dtype)``."""

    pipeline_stages = False  # the cache and state indices of a split are not mapped yet

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant: QuantMethod,
                 attention: AttentionBackend, max_model_len: int, *, moe: MoEBackend,
                 parallel: ParallelState | None = None, mixer: MixerBackend | None = None) -> None:
        if len(cfg.layer_types) != cfg.num_layers:
            raise ModelLoadError(f"model_type {cfg.model_type!r}: layer_types lists {len(cfg.layer_types)} "
                                 f"layers, num_hidden_layers is {cfg.num_layers}")
        if mixer is None:
            raise ModelLoadError(f"model_type {cfg.model_type!r}: its state layers need a mixer backend "
                                 "(`mixer:` section)")
        # read while the base class builds the layers
        self.mixer_backend = mixer
        self.cache_index = cache_indices(cfg.layer_types)
        self.model_dtype = dtype
        super().__init__(cfg, dtype, quant, attention, max_model_len, moe=moe, parallel=parallel)
        self.state_pools: list[dict[str, torch.Tensor]] = []

    def new_layer(self, index: int, dtype: torch.dtype, quant: QuantMethod, attention: AttentionBackend,
                  kv_layer: int | None = None) -> torch.nn.Module:
        kind = self.config.layer_types[index]
        if kind == ATTENTION:
            return super().new_layer(index, dtype, quant, attention,
                                     self.cache_index[index] if kv_layer is None else kv_layer)
        mixer = self.make_state_mixer(self.config, index, self.cache_index[index], dtype, quant)
        return self.make_decoder_layer(index, mixer, dtype, quant, attention)

    def make_decoder_layer(self, index: int, mixer: torch.nn.Module, dtype: torch.dtype, quant: QuantMethod,
                           attention: AttentionBackend) -> torch.nn.Module:
        """The decoder layer around state mixer ``mixer`` (default: the Llama ``DecoderLayer``
        with this layer's feed-forward block)."""
        from lmplug.kit.decoder import DecoderLayer

        return DecoderLayer(self.config, -1, dtype, quant, attention, self.make_mlp(self.config, index, dtype, quant),
                            mixer, tp=self.tp)

    def make_state_mixer(self, cfg: ModelConfig, layer: int, state_index: int, dtype: torch.dtype,
                         quant: QuantMethod) -> torch.nn.Module:
        """The state mixer of model layer ``layer`` (state layer ``state_index``)."""
        raise NotImplementedError(f"{type(self).__name__} builds no state mixer")

    def state_specs(self) -> tuple[StateSpec, ...]:
        kinds = self.config.layer_types
        return tuple(StateSpec(i, kinds[i], layer.self_attn.state_tensors(self.model_dtype))
                     for i, layer in enumerate(self.layers) if kinds[i] != ATTENTION)

    def bind_states(self, pools: list[dict[str, torch.Tensor]]) -> None:
        self.state_pools = pools

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        if self.tp.is_parallel:  # the slots rank 0's KV cache zeroed when it handed them out
            zero_fresh_states(self.state_pools, ctx)
        x = self.embed_tokens(input_ids)
        for layer, kind, index in zip(self.layers, self.config.layer_types, self.cache_index, strict=True):
            cache = self.kv_views[index] if kind == ATTENTION else self.state_pools[index]
            x = layer(x, positions, self.rope, cache, ctx)
        return self.norm(x)
