"""Independent GPTQ / AWQ packers for the tests (a helper module, not a test file).

Written from the published layouts in FORMATS.md with numpy, on purpose not
with ``lmplug_quant.packing``: a checkpoint written here and read by lmplug
checks lmplug's reading against the spec, not against itself.

Quantizers are plain min/max (asymmetric) round-to-nearest per group; what
matters is the layout, not the quality.
"""

from __future__ import annotations

import numpy as np
import torch

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble k of a word holds column AWQ_PACK_ORDER[k]


def pack_words(values: np.ndarray, bits: int, axis: int, order: list[int] | None = None) -> np.ndarray:
    """Pack unsigned ``values`` along ``axis`` into int32 words, element j of a word at bit j*bits."""
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    per = 32 // bits
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    if order is not None:
        v = v[..., order]
    word = np.zeros(v.shape[:-1], dtype=np.uint32)
    for j in range(per):
        word |= v[..., j] << np.uint32(j * bits)
    return np.ascontiguousarray(np.moveaxis(word.view(np.int32), -1, axis))


def minmax_quantize(w_in_out: torch.Tensor, g_idx: torch.Tensor, groups: int, bits: int):
    """Asymmetric RTN of ``W [in, out]`` per group of input rows -> (q [in, out], zeros [G, out],
    scales fp16 [G, out]). Group ``g`` is the rows ``i`` with ``g_idx[i] == g``."""
    maxq = 2**bits - 1
    w = w_in_out.double()
    scales = torch.empty(groups, w.shape[1], dtype=torch.float64)
    zeros = torch.empty(groups, w.shape[1], dtype=torch.int64)
    for g in range(groups):
        rows = w[g_idx == g]
        lo, hi = rows.min(0).values.clamp(max=0), rows.max(0).values.clamp(min=0)
        scales[g] = ((hi - lo) / maxq).clamp(min=1e-6)
        zeros[g] = torch.round(-lo / scales[g]).clamp(0, maxq).long()
    scales16 = scales.half()
    s = scales16.double()[g_idx.long()]
    q = torch.clamp(torch.round(w / s) + zeros[g_idx.long()], 0, maxq).long()
    return q, zeros, scales16


def dequantize(q, zeros, scales16, g_idx) -> torch.Tensor:
    """``W [in, out]`` float32 = (q - z[g]) * s[g]."""
    g = g_idx.long()
    return ((q - zeros[g]).double() * scales16.double()[g]).float()


def gptq_tensors(weight: torch.Tensor, *, bits: int, group_size: int, desc_act: bool, v1: bool,
                 seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """An nn.Linear weight [out, in] -> (GPTQ tensors, the dense [out, in] they stand for)."""
    n_in = weight.shape[1]
    group = n_in if group_size == -1 else group_size
    groups = n_in // group
    g_idx = torch.arange(n_in, dtype=torch.int32) // group
    if desc_act:  # act-order: rows are quantized in a permuted order, g_idx follows it
        perm = torch.randperm(n_in, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(n_in, dtype=torch.int32)
        g_idx[perm] = torch.arange(n_in, dtype=torch.int32) // group
    q, zeros, scales = minmax_quantize(weight.T, g_idx, groups, bits)
    stored_zeros = (zeros - 1) & (2**bits - 1) if v1 else zeros
    tensors = {
        "qweight": torch.from_numpy(pack_words(q.numpy(), bits, axis=0)),
        "qzeros": torch.from_numpy(pack_words(stored_zeros.numpy(), bits, axis=1)),
        "scales": scales,
        "g_idx": g_idx,
    }
    return tensors, dequantize(q, zeros, scales, g_idx).T.contiguous()


def awq_tensors(weight: torch.Tensor, *, group_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """An nn.Linear weight [out, in] -> (AWQ GEMM tensors, the dense [out, in] they stand for)."""
    n_in = weight.shape[1]
    group = n_in if group_size == -1 else group_size
    g_idx = torch.arange(n_in, dtype=torch.int32) // group
    q, zeros, scales = minmax_quantize(weight.T, g_idx, n_in // group, 4)
    tensors = {
        "qweight": torch.from_numpy(pack_words(q.numpy(), 4, axis=1, order=AWQ_PACK_ORDER)),
        "qzeros": torch.from_numpy(pack_words(zeros.numpy(), 4, axis=1, order=AWQ_PACK_ORDER)),
        "scales": scales,
    }
    return tensors, dequantize(q, zeros, scales, g_idx).T.contiguous()
