"""``ModelSource``: what every checkpoint reader hands the model builder (and offline quantizers).

Readers (HF folders, GGUF files) differ in file format but all produce the
same thing: an HF-style ``config.json`` dict, tensors under HF names
(``model.layers.0.self_attn.q_proj.weight`` ...), in HF layout (GGUF's Q/K
row permutation undone, quantized blocks dequantized), and a tokenizer. A reader of a
block-quantized format may also offer ``iter_packed``: the same tensors, with 2-D weights left
in their packed blocks (``lmplug.interfaces.packed.PackedTensor``), for quant methods that
multiply by them directly (``lmplug.kit.extras.PackedWeights``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class ModelSource:
    path: Path
    format: str  # "hf" or "gguf"
    hf_config: dict  # config.json contents (model_type, hidden_size, ...)
    tensor_names: list[str]  # every tensor the checkpoint holds, HF names
    iter_tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]  # yields (HF name, tensor), lazily
    tokenizer: Any | None = None  # ``encode(text) -> ids``, ``decode(ids)``, ``eos_token_ids`` (lmplug.loading.tokenizer)
    generation_config: dict = field(default_factory=dict)  # eos_token_id etc. when present
    # (HF name, lazy slice) pairs whose ``[a:b, ...]`` reads only that part (safetensors
    # ``get_slice``); tensor parallelism reads each rank's slice through it. None: whole tensors only
    iter_slices: Callable[[], Iterator[tuple[str, Any]]] | None = None
    # (HF name, tensor or PackedTensor) pairs: as ``iter_tensors``, but 2-D weights stay packed
    # (zero-copy views of the file where possible; rows already in HF order). None: dense only
    iter_packed: Callable[[], Iterator[tuple[str, Any]]] | None = None
