"""KV-cache tiles in Triton: write K/V through the slot mapping, read them through block tables.

Every attention kernel of ``flash`` and ``paged`` reads the same layout
(``lmplug.kit.kv_layout``): a layer's cache is ``[num_blocks,
block_size, Hkv, D]`` and position ``pos`` of sequence ``b`` sits in block
``block_tables[b, pos // block_size]`` at offset ``pos % block_size``. The
contiguous layout is one block of ``max_model_len`` slots per sequence, so one
kernel reads both. The pieces here are that read and the write, once:

- ``kv_tile_slots``: (block, offset) of a tile of ``BLOCK_N`` key positions.
  Tiles start at multiples of ``BLOCK_N``; when ``block_size`` is a multiple
  of ``BLOCK_N`` a tile lies in one block and the block id is one scalar load,
  otherwise it is looked up per position (any block size works). With
  ``PAGED=False`` the rows are the step's own packed K/V (``row0 + pos``);
- ``load_kv_tile``: the K and V rows [BLOCK_N, D_PAD] of those slots;
- ``dequant_kv_tile``: quantized KV (int8 / float8_e4m3fn caches with one
  float32 scale per (slot, KV head), ``[num_blocks, block_size, Hkv]``): the
  byte tile times its scales in fp32, cast to q's dtype: the op order of
  ``dequantize_kv``, so a kernel over a quantized cache gives exactly what it
  gives over ``dequantize_kv`` of that cache. An fp8 cache reaches the kernels
  as its bytes (``quant_args`` views it as uint8) and ``fp8e4m3_to_float``
  decodes them with integer ops: Triton has no float8_e4m3fn type before sm_89
  (an A100 could not compile a kernel that names it), and the decode is exact
  on every architecture;
- ``reshape_and_cache``: one program per new token copies its K and V rows
  into slot ``slot_mapping[t]`` (negative slots are padding, skipped). A
  quantized write is PyTorch's ``store_kv`` (a per-row amax, then a plain
  ``index_copy_``: memory bound, nothing for a kernel to fuse).

The reads are called from one loop, ``attn_ops.attend_tiles`` (and the MLA
kernel's slot lookup). The PyTorch reference of the write and of the
dequantizing gather is ``kv_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lmplug_attention import kv_ref

from lmplug.kit.kv_quant import KV_QMAX


@triton.jit
def kv_tile_slots(table_ptr, stride_btn, start, pos, valid, row0,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr):
    """(block, offset) int64 [BLOCK_N] of the key positions ``pos`` = ``start + arange(BLOCK_N)``."""
    if PAGED:
        if BLOCK_SIZE % BLOCK_N == 0:
            # tiles start at multiples of BLOCK_N, so the whole tile sits in one block
            block = tl.load(table_ptr + (start // BLOCK_SIZE) * stride_btn).to(tl.int64)
            block = tl.zeros([BLOCK_N], tl.int64) + block
        else:
            block = tl.load(table_ptr + (pos // BLOCK_SIZE) * stride_btn, mask=valid, other=0).to(tl.int64)
        offset = (pos % BLOCK_SIZE).to(tl.int64)
    else:
        block = tl.zeros([BLOCK_N], tl.int64)
        offset = (row0 + pos).to(tl.int64)
    return block, offset


@triton.jit
def load_kv_tile(k_ptr, v_ptr, block, offset, kv_head, offs_d, load_mask,
                 stride_kb, stride_kt, stride_kh, stride_kd,
                 stride_vb, stride_vt, stride_vh, stride_vd):
    """K and V rows [BLOCK_N, D_PAD]; masked-out elements are 0 (never NaN from unused slots)."""
    k_offs = (block * stride_kb + offset * stride_kt + kv_head * stride_kh)[:, None] + offs_d[None, :] * stride_kd
    v_offs = (block * stride_vb + offset * stride_vt + kv_head * stride_vh)[:, None] + offs_d[None, :] * stride_vd
    k = tl.load(k_ptr + k_offs, mask=load_mask, other=0.0)
    v = tl.load(v_ptr + v_offs, mask=load_mask, other=0.0)
    return k, v


QUANT_NONE, QUANT_INT8, QUANT_FP8 = 0, 1, 2  # the kernels' QUANT constexpr: what the cache bytes are


@triton.jit
def fp8e4m3_to_float(bits):
    """float8_e4m3fn bytes (uint8) -> their exact values in fp32, by integer ops only.

    e4m3fn is 1 sign, 4 exponent (bias 7) and 3 mantissa bits; shifting the 7 magnitude bits
    into an fp16's exponent and mantissa fields (bias 15) gives the same number times 2^-8,
    subnormals included (an e4m3 subnormal lands on an fp16 subnormal, which the fp16 -> fp32
    conversion keeps exactly). Times 256 in fp32 is exact. e4m3fn has no infinities; its only
    non-finite patterns, S.1111.111, are NaN.
    """
    b = bits.to(tl.int32)
    mag = b & 0x7F
    half = (((b & 0x80) << 8) | (mag << 7)).to(tl.uint16).to(tl.float16, bitcast=True)
    return tl.where(mag == 0x7F, float("nan"), half.to(tl.float32) * 256.0)


@triton.jit
def _kv_to_float(x, QUANT: tl.constexpr):
    if QUANT == 2:  # QUANT_FP8: the cache's bytes
        return fp8e4m3_to_float(x)
    return x.to(tl.float32)


@triton.jit
def dequant_kv_tile(k, v, k_scale_ptr, v_scale_ptr, block, offset, kv_head, valid,
                    stride_sb, stride_st, stride_sh, OUT_TY: tl.constexpr, QUANT: tl.constexpr):
    """Quantized K and V tiles [BLOCK_N, D_PAD] (int8, or fp8 bytes: ``QUANT``) times their
    (slot, KV head) scales, cast to OUT_TY."""
    offs = block * stride_sb + offset * stride_st + kv_head * stride_sh
    ks = tl.load(k_scale_ptr + offs, mask=valid, other=0.0)
    vs = tl.load(v_scale_ptr + offs, mask=valid, other=0.0)
    return ((_kv_to_float(k, QUANT) * ks[:, None]).to(OUT_TY),
            (_kv_to_float(v, QUANT) * vs[:, None]).to(OUT_TY))


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    num_kv_heads, head_dim,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_cb, stride_ct, stride_ch, stride_cd,
    BLOCK_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # a padding token
        return
    offs_h = tl.arange(0, HEADS_PAD)[:, None]
    offs_d = tl.arange(0, D_PAD)[None, :]
    mask = (offs_h < num_kv_heads) & (offs_d < head_dim)
    dst = ((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
           + offs_h * stride_ch + offs_d * stride_cd)
    row = t.to(tl.int64)  # token x stride passes 2^31 in a big enough batch
    k = tl.load(k_ptr + row * stride_kt + offs_h * stride_kh + offs_d * stride_kd, mask=mask)
    v = tl.load(v_ptr + row * stride_vt + offs_h * stride_vh + offs_d * stride_vd, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


# -- wrappers ----------------------------------------------------------------------------------------


def check_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                 v_scale: torch.Tensor | None, what: str) -> bool:
    """Whether the caches are quantized; clear errors for scales that do not fit them."""
    if k_scale is None and v_scale is None:
        return False
    if k_scale is None or v_scale is None:
        raise ValueError(f"{what}: give both k_scale and v_scale, or neither")
    if k_cache.dtype not in KV_QMAX or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{what}: quantized caches must be int8 or float8_e4m3fn, got "
                         f"{k_cache.dtype} and {v_cache.dtype}")
    if (k_scale.shape != k_cache.shape[:3] or v_scale.shape != k_scale.shape
            or k_scale.stride() != v_scale.stride()
            or k_scale.dtype != torch.float32 or v_scale.dtype != torch.float32):
        raise ValueError(f"{what}: k_scale and v_scale must be float32 [num_blocks, block_size, Hkv] = "
                         f"{tuple(k_cache.shape[:3])} with equal strides, got {tuple(k_scale.shape)} "
                         f"{k_scale.dtype} and {tuple(v_scale.shape)} {v_scale.dtype}")
    return True


def quant_args(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
               v_scale: torch.Tensor | None) -> tuple:
    """(k_cache, v_cache, (k_scale_ptr, v_scale_ptr), scale strides, QUANT) for a kernel launch on
    checked caches: an fp8 cache as its bytes (uint8 views: no fp8 type reaches the kernel),
    placeholder scales when unquantized."""
    if k_scale is None:
        return k_cache, v_cache, (k_cache, k_cache), (0, 0, 0), QUANT_NONE
    if k_cache.dtype == torch.float8_e4m3fn:
        return (k_cache.view(torch.uint8), v_cache.view(torch.uint8), (k_scale, v_scale),
                tuple(k_scale.stride()), QUANT_FP8)
    return k_cache, v_cache, (k_scale, v_scale), tuple(k_scale.stride()), QUANT_INT8


def _check_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    if (k.shape != v.shape or k.dim() != 3 or k.shape[1:] != k_cache.shape[2:]
            or k_cache.shape != v_cache.shape):
        raise ValueError(f"reshape_and_cache: k, v must be [T, Hkv, D] matching the caches' "
                         f"[num_blocks, block_size, Hkv, D]; got k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype or k_cache.stride() != v_cache.stride():
        raise ValueError(f"reshape_and_cache: dtypes must match the cache ({k_cache.dtype}) and the caches "
                         f"share strides; got k {k.dtype}, v {v.dtype}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"reshape_and_cache: slot_mapping must be [T={k.shape[0]}], "
                         f"got {tuple(slot_mapping.shape)}")


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    """k, v: [T, Hkv, D] -> cache slots ``slot_mapping`` [T] of k_cache, v_cache [N, block_size, Hkv, D].

    With ``k_scale`` / ``v_scale`` (quantized caches) the write is PyTorch's ``store_kv``.
    """
    if check_scales(k_cache, v_cache, k_scale, v_scale, "reshape_and_cache"):
        kv_ref.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    _check_write(k, v, k_cache, v_cache, slot_mapping)
    if k.shape[0] == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _reshape_and_cache_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping, num_kv_heads, head_dim,
        *k.stride(), *v.stride(), *k_cache.stride(),
        BLOCK_SIZE=block_size, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim))
