"""The named batch specs the attention suite runs, in the spirit of vLLM's ``small_decode`` /
``mixed_medium`` tables: each one a single step of a real engine.

A spec lists, per sequence, how many tokens this step computes (``query_lens``)
and how many were cached before it (``context_lens``). As in ``StepContext``,
decodes (one new token after some cached context) come first. Sizes stay small
enough for Triton kernels under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmplug.interfaces.attention import LayerAttention, needed_features


@dataclass(frozen=True)
class BatchSpec:
    name: str
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16  # for paged layouts; contiguous uses one block per sequence
    sliding_window: int | None = None
    scale: float | None = None  # None: head_dim ** -0.5
    layer: int = 0
    softcap: float | None = None  # scores soft-capped: softcap * tanh(scores / softcap)
    # the backend is built with per-layer ``LayerAttention``s: layer ``layer`` attends with this
    # spec's scale, window and soft-cap, the layers before it with another scale and no window
    # (a backend that reads its constructor's scale and window, not its layer's, fails)
    per_layer: bool = False

    def __post_init__(self) -> None:
        if len(self.query_lens) != len(self.context_lens):
            raise ValueError(
                f"batch spec {self.name!r}: query_lens and context_lens differ in length"
            )
        if min(self.query_lens) < 1 or min(self.context_lens) < 0:
            raise ValueError(
                f"batch spec {self.name!r}: query_lens must be >= 1, context_lens >= 0"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"batch spec {self.name!r}: num_heads must be a multiple of num_kv_heads"
            )
        decode = [q == 1 and c > 0 for q, c in zip(self.query_lens, self.context_lens)]
        if decode != sorted(decode, reverse=True):
            raise ValueError(
                f"batch spec {self.name!r}: decodes must come first, as in StepContext"
            )

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(q + c for q, c in zip(self.query_lens, self.context_lens))

    @property
    def num_decodes(self) -> int:
        return sum(q == 1 and c > 0 for q, c in zip(self.query_lens, self.context_lens))

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else self.head_dim**-0.5

    def layer_attentions(self) -> tuple[LayerAttention, ...]:
        """The ``layers`` the backend is built with (() unless ``per_layer`` or a soft-cap)."""
        if not self.per_layer and self.softcap is None:
            return ()
        own = LayerAttention(self.softmax_scale, self.sliding_window, self.softcap)
        other = LayerAttention(0.5 * self.softmax_scale) if self.per_layer else own
        return (other,) * self.layer + (own,)

    @property
    def required_features(self) -> frozenset[str]:
        if self.per_layer or self.softcap is not None:
            return frozenset(needed_features(self.layer_attentions()))
        return frozenset({"sliding_window"}) if self.sliding_window is not None else frozenset()

    def describe(self) -> str:
        window = f", sliding_window={self.sliding_window}" if self.sliding_window else ""
        scale = f", scale={self.scale}" if self.scale is not None else ""
        scale += f", softcap={self.softcap}" if self.softcap is not None else ""
        scale += f", per-layer attention (layer {self.layer})" if self.per_layer else ""
        return (
            f"query_lens={list(self.query_lens)}, context_lens={list(self.context_lens)}, "
            f"heads={self.num_heads}/{self.num_kv_heads} (q/kv), head_dim={self.head_dim}"
            f"{window}{scale}"
        )


def _spec(
    name: str,
    query_lens: list[int],
    context_lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    **kw,
) -> BatchSpec:
    return BatchSpec(name, tuple(query_lens), tuple(context_lens), heads, kv_heads, head_dim, **kw)


BATCH_SPECS: dict[str, BatchSpec] = {
    s.name: s
    for s in [
        # decode only: one new token after cached context; GQA ratios 1, 4, 8; head dims 64, 128
        _spec("decode_small", [1, 1, 1, 1], [4, 16, 1, 33], 4, 4, 64),
        _spec("decode_gqa4", [1, 1, 1], [40, 7, 64], 8, 2, 64),
        _spec("decode_gqa8_d128", [1, 1], [23, 48], 8, 1, 128, layer=3),
        # prefill only; a one-token prompt is a prefill, not a decode
        _spec("prefill_small", [7, 16, 1], [0, 0, 0], 4, 4, 64),
        _spec("prefill_gqa4_d128", [19, 33], [0, 0], 8, 2, 128),
        _spec("prefill_gqa8", [12, 5], [0, 0], 8, 1, 64),
        # new tokens after cached ones: chunked prefill, or a prefix-cache hit
        _spec("prefill_cached_prefix", [9, 20], [16, 35], 4, 2, 64),
        # decodes and prefills in one step, variable lengths, small and odd block sizes
        _spec("mixed", [1, 1, 12, 5], [30, 3, 0, 20], 8, 2, 64),
        _spec(
            "varlen_block8", [1, 1, 1, 40, 2, 17], [63, 1, 15, 0, 100, 7], 4, 1, 64, block_size=8
        ),
        _spec("block_boundaries", [1, 16, 15], [31, 0, 17], 4, 2, 64),
        # long contexts (kept to a few hundred tokens so interpreted kernels stay fast)
        _spec("long_decode", [1, 1], [511, 300], 4, 1, 64, block_size=32),
        _spec("long_prefill", [192, 1], [64, 0], 4, 2, 64, block_size=32),
        # a softmax scale other than head_dim ** -0.5 (the backend must use the one it is given)
        _spec("custom_scale", [1, 6], [10, 4], 4, 2, 64, scale=0.05),
        # sliding windows: only for backends whose capabilities list "sliding_window"
        _spec("sliding_window_prefill", [20, 5], [0, 30], 4, 2, 64, sliding_window=8),
        _spec("sliding_window_decode", [1, 1], [40, 10], 4, 2, 64, sliding_window=16),
        _spec("sliding_window_mixed", [1, 24], [50, 20], 4, 1, 128, sliding_window=32),
        # attention-logit soft-capping (Gemma 2): backends listing "logit_softcap"
        _spec("softcap_mixed", [1, 1, 12, 5], [30, 3, 0, 20], 8, 2, 64, softcap=2.0, scale=0.5),
        # each layer its own scale and window (Gemma 2/3): backends listing "layer_windows" and
        # "layer_scales"; the layer under test has a window, the ones before it none
        _spec("layer_window_mixed", [1, 1, 17, 6], [40, 5, 0, 20], 4, 2, 64, sliding_window=8,
              scale=0.2, layer=1, per_layer=True),
        _spec("layer_softcap_window_decode", [1, 1], [40, 10], 4, 2, 64, sliding_window=16, softcap=3.0,
              scale=0.3, layer=2, per_layer=True),
    ]
}
