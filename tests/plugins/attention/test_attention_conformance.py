"""The first-party attention backends through the conformance suite (``lmplug.testing.AttentionConformance``).

This is what a plugin author writes, too: subclass, name the backend, set
options. Triton backends run under ``TRITON_INTERPRET=1`` on machines without
a GPU (set by ``tests/conftest.py`` and by the suite's pytest plugin); there
they run a representative subset of the batch specs, and the full table on a GPU.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from lmplug.testing import AttentionConformance

# Under the interpreter a Triton prefill of a few hundred tokens takes seconds: keep one spec of
# each kind (decode, prefill, cached prefix, mixed, odd block size, block edges, long context,
# custom scale, sliding window, head_dim 128, GQA 8).
INTERPRETER_SPECS = [
    "decode_gqa8_d128",
    "prefill_small",
    "prefill_cached_prefix",
    "mixed",
    "varlen_block8",
    "block_boundaries",
    "long_decode",
    "custom_scale",
    "sliding_window_mixed",
    "layer_window_mixed",
    "softcap_mixed",
    "layer_softcap_window_decode",
]
TRITON_SPECS = None if torch.cuda.is_available() else INTERPRETER_SPECS

# -- attention --------------------------------------------------------------------------------------


class TestSdpaAttention(AttentionConformance):
    backend = "sdpa"


class TestPagedAttentionTorch(AttentionConformance):
    backend = "paged"
    options: ClassVar[dict] = {"kernels": "torch"}


class TestPagedAttentionTriton(AttentionConformance):
    backend = "paged"
    options: ClassVar[dict] = {"kernels": "triton"}
    # what the Triton kernels give (``PagedAttention.features_for``): no tree masks
    features = ("sliding_window", "layer_windows", "layer_scales", "logit_softcap", "attention_sinks")
    specs = TRITON_SPECS
    skip_bf16_under_triton_interpreter = True


class TestFlashAttention(AttentionConformance):
    backend = "flash"
    specs = TRITON_SPECS
    skip_bf16_under_triton_interpreter = True
