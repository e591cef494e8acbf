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


# -- W8A8 and compressed-tensors (FORMATS.md "FP8"; compressed-tensors' published layouts) ---------

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _to_fp8(values: torch.Tensor) -> torch.Tensor:
    return values.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_tensor_or_channel(weight: torch.Tensor, per_channel: bool):
    """compressed-tensors float-quantized, strategy tensor (``weight_scale [1]``) or channel
    (``[out, 1]``): ``weight`` = fp8(w / scale), scale = max|w| / 448 -> (tensors, dense [out, in])."""
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().max().reshape(1)
    scale = amax / FP8_MAX
    q = _to_fp8(w / (scale if per_channel else scale.reshape(1, 1)))
    dense = q.float() * (scale if per_channel else scale.reshape(1, 1))
    return {"weight": q, "weight_scale": scale}, dense


def fp8_block(weight: torch.Tensor, block: tuple[int, int], scale_name: str = "weight_scale_inv"):
    """Block-scaled fp8 (HF ``quant_method: fp8``, DeepSeek-V3): one scale per ``block`` of
    [rows, cols], ``[ceil(out/rows), ceil(in/cols)]``, edge blocks partial; real = fp8 * scale."""
    w = weight.float()
    out_f, in_f = w.shape
    bn, bk = block
    scales = torch.empty((out_f + bn - 1) // bn, (in_f + bk - 1) // bk)
    q = torch.empty(out_f, in_f, dtype=torch.float8_e4m3fn)
    dense = torch.empty(out_f, in_f)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            s = tile.abs().max() / FP8_MAX
            scales[i, j] = s
            qt = _to_fp8(tile / s)
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = qt
            dense[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = qt.float() * s
    return {"weight": q, scale_name: scales}, dense


def int8_channel(weight: torch.Tensor):
    """compressed-tensors int-quantized (SmoothQuant W8A8): int8 ``weight``, ``weight_scale [out, 1]``
    = max|w| / 127, symmetric round-to-nearest."""
    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def pack_quantized(weight: torch.Tensor, bits: int, group_size: int):
    """compressed-tensors pack-quantized: symmetric ``bits``-bit values per group of inputs, stored
    ``+ 2**(bits-1)`` and packed 32/bits per int32 word along the input (value j at bit j*bits):
    ``weight_packed [out, in*bits/32]``, ``weight_scale [out, in/group]``, ``weight_shape [2]``."""
    w = weight.float()
    out_f, in_f = w.shape
    half = 2 ** (bits - 1)
    grouped = w.reshape(out_f, in_f // group_size, group_size)
    scale = grouped.abs().amax(-1) / (half - 1)
    q = torch.round(grouped / scale[..., None]).clamp(-half, half - 1).reshape(out_f, in_f).long()
    words = pack_words((q + half).numpy(), bits, axis=1)
    dense = (q.float().reshape(out_f, -1, group_size) * scale[..., None]).reshape(out_f, in_f)
    tensors = {"weight_packed": torch.from_numpy(words), "weight_scale": scale,
               "weight_shape": torch.tensor([out_f, in_f], dtype=torch.int64)}
    return tensors, dense


def fake_quantize_input(x: torch.Tensor, kind: str, mode: str, group: int = 0,
                        static_scale: float | None = None) -> torch.Tensor:
    """What a W8A8 layer does to its input, in float32: ``mode`` token (a scale per row, max|x| /
    qmax), group (per row per ``group`` inputs), tensor (one scale), static (``static_scale``);
    fp8: clamp(x / s) cast to e4m3; int8: clamp(round(x / s), -128, 127); times s again."""
    xf = x.float()
    qmax = FP8_MAX if kind == "fp8" else 127.0
    shape = xf.shape
    rows = xf.reshape(-1, shape[-1])
    if mode == "group":
        k = rows.shape[1]
        out = torch.empty_like(rows)
        for start in range(0, k, group):
            out[:, start:start + group] = fake_quantize_input(rows[:, start:start + group], kind, "token")
        return out.reshape(shape).to(x.dtype)
    if mode == "token":
        scale = rows.abs().amax(dim=1, keepdim=True) / qmax
    elif mode == "tensor":
        scale = rows.abs().max().reshape(1, 1) / qmax
    else:
        scale = torch.tensor([[static_scale]], dtype=torch.float32)
    if kind == "fp8":
        q = _to_fp8(rows / scale).float()
    else:
        q = torch.round(rows / scale).clamp(-128, 127)
    return (q * scale).reshape(shape).to(x.dtype)
