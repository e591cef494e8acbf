"""Checkpoint tensors of one quantized linear layer in the published layouts (FORMATS.md).

- GPTQ v1 (``checkpoint_format: gptq``): ``qweight`` int32 ``[in * bits / 32, out]`` packed
  along the input, ``qzeros`` int32 ``[groups, out * bits / 32]`` holding ``zero - 1``,
  ``scales [groups, out]``, ``g_idx`` int32 ``[in]``.
- AWQ GEMM: ``qweight`` int32 ``[in, out / 8]`` and ``qzeros [groups, out / 8]`` packed along
  the output with AWQ's interleave, zeros as is, ``scales [groups, out]``.
- compressed-tensors per-channel 8-bit: ``weight`` int8 / float8_e4m3fn ``[out, in]`` and
  ``weight_scale`` float32 ``[out, 1]``.
"""

from __future__ import annotations

import torch
from lmplug_quant.packing import AWQ_ORDER, pack_cols, pack_rows

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def gptq_tensors(name: str, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 g_idx: torch.Tensor, bits: int, dtype: str) -> dict[str, torch.Tensor]:
    """``q [out, in]`` (0 .. 2**bits - 1), ``scales``/``zeros [groups, out]``, ``g_idx [in]``."""
    v1_zeros = (zeros.to(torch.int64) - 1) & (2**bits - 1)
    return {f"{name}.qweight": pack_rows(q.T.contiguous(), bits),
            f"{name}.qzeros": pack_cols(v1_zeros.to(torch.int32), bits),
            f"{name}.scales": scales.to(DTYPES[dtype]),
            f"{name}.g_idx": g_idx.to(torch.int32)}


def gptq_config(bits: int, group_size: int, desc_act: bool, sym: bool) -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act,
            "sym": sym, "checkpoint_format": "gptq"}


def awq_tensors(name: str, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                dtype: str) -> dict[str, torch.Tensor]:
    """4-bit ``q [out, in]``, ``scales``/``zeros [groups, out]``."""
    return {f"{name}.qweight": pack_cols(q.T.contiguous(), 4, AWQ_ORDER),
            f"{name}.qzeros": pack_cols(zeros.to(torch.int32), 4, AWQ_ORDER),
            f"{name}.scales": scales.to(DTYPES[dtype])}


def awq_config(group_size: int) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
            "version": "gemm"}


def channel8_tensors(name: str, weight: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    return {f"{name}.weight": weight, f"{name}.weight_scale": scale.reshape(-1, 1).float()}


def compressed_tensors_config(kind: str) -> dict:
    """``kind``: "float" (FP8 e4m3) or "int" (int8); per-channel weights, dynamic per-token
    activations, lm_head left alone."""
    fmt = "float-quantized" if kind == "float" else "int-quantized"
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "channel",
                            "dynamic": False},
                "input_activations": {"num_bits": 8, "type": kind, "strategy": "token", "dynamic": True,
                                      "symmetric": True}}},
            "ignore": ["lm_head"]}
