"""Mamba2's SSD scan in Triton: the chunked prefill scan and the fused one-token state update.

Same arguments and results as ``ssd_ref.ssd_chunk_scan`` / ``ssd_ref.ssd_state_update``
(the math is written there).

Chunked scan: one program per (sequence, head, tile of ``BLOCK_P`` head dims)
walks its sequence ``CHUNK`` tokens at a time. Per chunk it builds the running
sum ``c`` of ``dt A`` (``tl.cumsum``), the masked quadratic form
``(C B^T) * exp(c_l - c_s) * dt_s`` (``[CHUNK, CHUNK]``), and writes
``y = form @ x + exp(c) * (C @ S^T) + D x``; and moves the state to the
chunk's end, ``S = exp(c_last) S + (x * dt * exp(c_last - c))^T @ B``. The
program's slice of the state, ``S [BLOCK_P, N]`` fp32, lives in its own rows
of the final state (the initial state copied there first, or already there
with a pool): per chunk, a loop over the state lanes ``BLOCK_N`` at a time
loads those columns of ``S``, B and C, accumulates ``C B^T`` and ``C S^T``
over them, moves the columns to the chunk's end and stores them back.
Barriers order every thread's read of a column before its overwrite, and a
chunk's writes before the next chunk's reads; the slice is the program's
alone, so the round trips stay in L1/L2. Why not the whole slice in
registers (the first version): products over all N = 128 lanes at once
spilled on sm_80 and sm_90 (Triton 3.7.1, ``make gpu-compile``): 0.3-5 KB
in fp16/bf16 at CHUNK 64, and 0.5-13.5 KB in fp32 at every chunk, whose
exact (``ieee``) products run on the CUDA cores and hold a whole N of
operands per thread.
The whole scan is one launch, with no intermediate chunk states in memory.
The price: the chunks of one sequence are walked one after another, so
parallelism is over sequences, heads and head-dim tiles only (H * P /
BLOCK_P programs per sequence: 96 to 512 for the published Mamba2 sizes,
H = 24..128, P = 64); mamba_ssm's five-kernel split also parallelizes over
chunks, which matters for one very long prompt. The kernel's chunk is the
model's ``chunk_size`` clamped to a power of two in [16, 64]: the result is
the same sum, only rounded differently, and a [CHUNK, CHUNK] fp32 tile
beyond 64 would spill.

Launch sizes per architecture and input width: ``SCAN_TABLE``, chosen so
that every configuration ``make gpu-compile`` builds (N = 64 / 128, chunks
16 / 32 / 64) compiles without spills on sm_80 and sm_90; not yet timed on a
GPU (nor whether software pipelining, ``num_stages`` > 1, would pay).

Sequences are flattened along dim 0 (``cu_seqlens``); a chunk never crosses a
sequence start, and its tail past the sequence end is masked with dt = 0.

softplus is torch's (threshold 20), with log1p computed stably (Kahan's trick)
since dt + dt_bias is often around -5, where log(1 + e^x) in fp32 loses digits.

Precision: operands are widened to fp32 in registers; fp32 inputs take exact
fp32 dot products (``input_precision="ieee"``), 16-bit inputs TF32 ones (their
operands were 16-bit already, so only the fp32 intermediates are rounded, to
TF32's 10 mantissa bits: no coarser than the inputs). Accumulation and the state are always fp32.

State update: one program per (sequence, head, head-dim tile); no dot products.

State slots (``state_indices``, semantics in ``ssd_ref``): the kernels offset the
pool by ``slot * stride`` where they would offset a per-batch state by
``sequence * stride``; nothing is gathered or copied. The scan then walks its
state in the slot itself.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from lmplug_mixer.conv1d_ref import check_state_indices

from lmplug.kit.devices import capability
from lmplug.kit.triton_launch import arch_entry, dot_precision

MIN_CHUNK = 16
# the scan's launch sizes per architecture (``attn_ops.arch_entry``) and input width (16-bit / fp32):
# (largest CHUNK, BLOCK_P, BLOCK_N, num_warps); None: the interpreter, whose BLOCK_N of 16 walks the
# state lanes in tiles
SCAN_TABLE: dict[tuple[int, int] | None, dict[str, tuple[int, int, int, int]]] = {
    None: {"16-bit": (64, 32, 16, 4), "fp32": (64, 32, 16, 4)},
    (8, 0): {"16-bit": (64, 16, 32, 8), "fp32": (64, 16, 32, 4)},
    (9, 0): {"16-bit": (64, 16, 32, 8), "fp32": (64, 16, 32, 4)},
}
UPDATE_BLOCK_P = 32  # head dims per program of the state update, which holds all N state lanes


@triton.jit
def _softplus(x):
    # torch.nn.functional.softplus (beta 1, threshold 20): log1p(e^x) by Kahan's trick
    u = tl.exp(tl.minimum(x, 20.0))
    w = 1.0 + u
    log1p = tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
    return tl.where(x > 20.0, x, log1p)


@triton.jit
def _discretize_dt(dt, dt_bias_ptr, head, dt_min, dt_max, HAS_DT_BIAS: tl.constexpr,
                   DT_SOFTPLUS: tl.constexpr):
    if HAS_DT_BIAS:
        dt = dt + tl.load(dt_bias_ptr + head).to(tl.float32)
    if DT_SOFTPLUS:
        dt = _softplus(dt)
    return tl.minimum(tl.maximum(dt, dt_min), dt_max)


@triton.jit
def _ssd_chunk_scan_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, cu_ptr, idx_ptr, init_ptr, y_ptr, final_ptr,
    dt_min, dt_max, heads_per_group, head_dim, state_size,
    stride_xt, stride_xh, stride_xp,
    stride_dtt, stride_dth,
    stride_bt, stride_bg, stride_bn,
    stride_ct, stride_cg, stride_cn,
    stride_ib, stride_ih, stride_ip, stride_in,
    stride_yt, stride_yh,
    stride_fb, stride_fh, stride_fp, stride_fn,
    CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_INIT: tl.constexpr,
    HAS_INDICES: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)  # sequence x state stride passes 2^31 in a large pool
    if HAS_INDICES:
        row = tl.load(idx_ptr + seq).to(tl.int64)  # the sequence's slot in the state pool
    else:
        row = seq
    head = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, CHUNK)
    mask_p = offs_p < head_dim
    group = head // heads_per_group
    bos = tl.load(cu_ptr + seq).to(tl.int64)
    eos = tl.load(cu_ptr + seq + 1).to(tl.int64)
    A = tl.load(A_ptr + head).to(tl.float32)
    # the program's state slice [BLOCK_P, N] lives in its rows of the final state
    state_ptrs = (final_ptr + row * stride_fb + head * stride_fh + offs_p[:, None] * stride_fp
                  + offs_n[None, :] * stride_fn)

    if not HAS_INDICES:  # with indices the initial state already is the final one (in place)
        for n0 in range(0, state_size, BLOCK_N):
            mask_pn = mask_p[:, None] & (n0 + offs_n < state_size)[None, :]
            if HAS_INIT:
                tile = tl.load(init_ptr + row * stride_ib + head * stride_ih + offs_p[:, None] * stride_ip
                               + (n0 + offs_n)[None, :] * stride_in, mask=mask_pn, other=0.0)
            else:
                tile = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
            tl.store(state_ptrs + n0 * stride_fn, tile, mask=mask_pn)
    causal = offs_l[:, None] >= offs_l[None, :]

    for start in range(bos, eos, CHUNK):
        tl.debug_barrier()  # the state tiles written before (other threads' stores) are visible
        t = start + offs_l
        mask_t = t < eos
        dt = tl.load(dt_ptr + t * stride_dtt + head * stride_dth, mask=mask_t, other=0.0).to(tl.float32)
        dt = _discretize_dt(dt, dt_bias_ptr, head, dt_min, dt_max, HAS_DT_BIAS, DT_SOFTPLUS)
        dt = tl.where(mask_t, dt, 0.0)  # the tail past the sequence: no decay, no input
        cum = tl.cumsum(dt * A, axis=0)  # [CHUNK]
        total = tl.sum(dt * A, axis=0)
        x = tl.load(x_ptr + t[:, None] * stride_xt + head * stride_xh + offs_p[None, :] * stride_xp,
                    mask=mask_t[:, None] & mask_p[None, :], other=0.0).to(tl.float32)  # [CHUNK, BLOCK_P]
        weighted = x * (dt * tl.exp(total - cum))[:, None]  # how each token enters the chunk's end state
        scores = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
        y_state = tl.zeros([CHUNK, BLOCK_P], dtype=tl.float32)
        # over the state lanes BLOCK_N at a time: C B^T, C S^T with the chunk's start state, and
        # the state's columns moved to the chunk's end
        for n0 in range(0, state_size, BLOCK_N):
            mask_n = n0 + offs_n < state_size
            mask_tn = mask_t[:, None] & mask_n[None, :]
            b = tl.load(B_ptr + t[:, None] * stride_bt + group * stride_bg + (n0 + offs_n)[None, :] * stride_bn,
                        mask=mask_tn, other=0.0).to(tl.float32)  # [CHUNK, BLOCK_N]
            c = tl.load(C_ptr + t[:, None] * stride_ct + group * stride_cg + (n0 + offs_n)[None, :] * stride_cn,
                        mask=mask_tn, other=0.0).to(tl.float32)
            mask_pn = mask_p[:, None] & mask_n[None, :]
            state = tl.load(state_ptrs + n0 * stride_fn, mask=mask_pn, other=0.0)  # [BLOCK_P, BLOCK_N]
            scores += tl.dot(c, tl.trans(b), input_precision=PRECISION)  # [CHUNK (l), CHUNK (s)]
            y_state += tl.dot(c, tl.trans(state), input_precision=PRECISION)
            state = state * tl.exp(total) + tl.dot(tl.trans(weighted), b, input_precision=PRECISION)
            tl.debug_barrier()  # every thread's read of these columns is done before they are overwritten
            tl.store(state_ptrs + n0 * stride_fn, state, mask=mask_pn)
        # inside the chunk: (C_l . B_s) exp(c_l - c_s) dt_s for s <= l; and from the chunk's start state
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        y = tl.dot(scores * decay * dt[None, :], x, input_precision=PRECISION) + tl.exp(cum)[:, None] * y_state
        if HAS_D:
            y += tl.load(D_ptr + head).to(tl.float32) * x
        tl.store(y_ptr + t[:, None] * stride_yt + head * stride_yh + offs_p[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_p[None, :])


@triton.jit
def _ssd_state_update_kernel(
    state_ptr, idx_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, y_ptr,
    dt_min, dt_max, heads_per_group, head_dim, state_size,
    stride_sb, stride_sh, stride_sp, stride_sn,
    stride_xb, stride_xh, stride_xp,
    stride_dtb, stride_dth,
    stride_bb, stride_bg, stride_bn,
    stride_cb, stride_cg, stride_cn,
    stride_yb, stride_yh,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_INDICES: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)  # a pool of states passes 2^31 elements quickly
    if HAS_INDICES:
        row = tl.load(idx_ptr + seq).to(tl.int64)  # the sequence's slot in the state pool
    else:
        row = seq
    head = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < head_dim
    mask_n = offs_n < state_size
    mask_pn = mask_p[:, None] & mask_n[None, :]
    group = head // heads_per_group

    dt = tl.load(dt_ptr + seq * stride_dtb + head * stride_dth).to(tl.float32)
    dt = _discretize_dt(dt, dt_bias_ptr, head, dt_min, dt_max, HAS_DT_BIAS, DT_SOFTPLUS)
    A = tl.load(A_ptr + head).to(tl.float32)
    x = tl.load(x_ptr + seq * stride_xb + head * stride_xh + offs_p * stride_xp, mask=mask_p,
                other=0.0).to(tl.float32)
    b = tl.load(B_ptr + seq * stride_bb + group * stride_bg + offs_n * stride_bn, mask=mask_n,
                other=0.0).to(tl.float32)
    c = tl.load(C_ptr + seq * stride_cb + group * stride_cg + offs_n * stride_cn, mask=mask_n,
                other=0.0).to(tl.float32)
    state_ptrs = (state_ptr + row * stride_sb + head * stride_sh + offs_p[:, None] * stride_sp
                  + offs_n[None, :] * stride_sn)
    state = tl.load(state_ptrs, mask=mask_pn, other=0.0)
    state = state * tl.exp(dt * A) + (dt * x)[:, None] * b[None, :]
    tl.store(state_ptrs, state, mask=mask_pn)
    y = tl.sum(state * c[None, :], axis=1)
    if HAS_D:
        y += tl.load(D_ptr + head).to(tl.float32) * x
    tl.store(y_ptr + seq * stride_yb + head * stride_yh + offs_p, y.to(y_ptr.dtype.element_ty), mask=mask_p)


def _check(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
           D: torch.Tensor | None, what: str) -> None:
    if x.dim() != 3 or dt.shape != x.shape[:2] or B.dim() != 3 or C.shape != B.shape:
        raise ValueError(f"{what}: x must be [T, H, P], dt [T, H], B and C [T, G, N]; got x "
                         f"{tuple(x.shape)}, dt {tuple(dt.shape)}, B {tuple(B.shape)}, C {tuple(C.shape)}")
    num_heads, num_groups = x.shape[1], B.shape[1]
    if B.shape[0] != x.shape[0] or num_heads % num_groups:
        raise ValueError(f"{what}: B/C need one row per token of x and a group count dividing the "
                         f"{num_heads} heads; got {tuple(B.shape)}")
    if A.shape != (num_heads,) or (D is not None and D.shape != (num_heads,)):
        raise ValueError(f"{what}: A and D must be [H] = [{num_heads}]")


def _state_check(state: torch.Tensor | None, batch: int, x: torch.Tensor, state_size: int,
                 state_indices: torch.Tensor | None, what: str) -> None:
    rows = batch
    if state_indices is not None:
        check_state_indices(state_indices, state, batch, what)
        rows = state.shape[0]  # a pool: any number of slots
    expected = (rows, x.shape[1], x.shape[2], state_size)
    if state is not None and (tuple(state.shape) != expected or state.dtype != torch.float32):
        raise ValueError(f"{what}: the state must be float32 {list(expected)}; got {state.dtype} "
                         f"{list(state.shape)}")


def _block_p(head_dim: int, largest: int) -> int:
    return max(16, min(largest, triton.next_power_of_2(head_dim)))


def _flags(D: torch.Tensor | None, dt_bias: torch.Tensor | None, dt_softplus: bool) -> dict:
    return {"HAS_D": D is not None, "HAS_DT_BIAS": dt_bias is not None, "DT_SOFTPLUS": dt_softplus}


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor | None, cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None,
                   chunk_size: int, *, dt_bias: torch.Tensor | None = None, dt_softplus: bool = True,
                   dt_limit: tuple[float, float] = (0.0, math.inf), state_indices: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, H, P], dt [T, H], A [H], B and C [T, G, N], D [H] or None, cu_seqlens [B+1],
    initial_state [B, H, P, N] fp32 or None (zeros) -> (y [T, H, P] in x's dtype, final_state
    [B, H, P, N] fp32). Inputs may be strided views (the split of Mamba2's projection). With
    ``state_indices`` [B]: initial_state is the pool [num_slots, H, P, N] fp32, its rows
    state_indices overwritten in place by the final states, and None returned for them."""
    _check(x, dt, A, B, C, D, "ssd_chunk_scan")
    num_tokens, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1:]
    batch = cu_seqlens.shape[0] - 1
    _state_check(initial_state, batch, x, state_size, state_indices, "ssd_chunk_scan")
    y = torch.empty(num_tokens, num_heads, head_dim, dtype=x.dtype, device=x.device)
    if state_indices is not None:
        final = initial_state  # rows state_indices written in place
    else:
        final = torch.empty(batch, num_heads, head_dim, state_size, dtype=torch.float32, device=x.device)
    result = None if state_indices is not None else final
    if batch == 0:
        return y, result
    entry = arch_entry(SCAN_TABLE, capability(x.device))["fp32" if x.dtype == torch.float32 else "16-bit"]
    max_chunk, block_p, block_n, num_warps = entry
    block_p = _block_p(head_dim, block_p)
    init = initial_state if initial_state is not None else final  # not read without HAS_INIT
    grid = (batch, num_heads, triton.cdiv(head_dim, block_p))
    _ssd_chunk_scan_kernel[grid](
        x, dt, A, B, C, D if D is not None else A, dt_bias if dt_bias is not None else A,
        cu_seqlens, state_indices if state_indices is not None else cu_seqlens, init, y, final,
        float(dt_limit[0]), float(dt_limit[1]), num_heads // num_groups, head_dim, state_size,
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *init.stride(), y.stride(0), y.stride(1),
        *final.stride(),
        CHUNK=max(MIN_CHUNK, min(max_chunk, triton.next_power_of_2(chunk_size))), BLOCK_P=block_p,
        BLOCK_N=min(block_n, max(16, triton.next_power_of_2(state_size))), HAS_INIT=initial_state is not None,
        HAS_INDICES=state_indices is not None, PRECISION=dot_precision(x.dtype), num_warps=num_warps,
        num_stages=1, **_flags(D, dt_bias, dt_softplus),
    )
    return y, result


def ssd_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                     B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None = None,
                     dt_bias: torch.Tensor | None = None, *, dt_softplus: bool = True,
                     dt_limit: tuple[float, float] = (0.0, math.inf),
                     state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """One token per sequence: state [B, H, P, N] fp32 (updated in place), x [B, H, P], dt [B, H],
    A [H], B and C [B, G, N], D [H] or None -> y [B, H, P] in x's dtype. With ``state_indices``
    [B]: state is the pool [num_slots, H, P, N], rows state_indices updated in place."""
    _check(x, dt, A, B, C, D, "ssd_state_update")
    batch, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1:]
    _state_check(state, batch, x, state_size, state_indices, "ssd_state_update")
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if batch == 0:
        return y
    block_p = _block_p(head_dim, UPDATE_BLOCK_P)
    block_n = max(16, triton.next_power_of_2(state_size))
    grid = (batch, num_heads, triton.cdiv(head_dim, block_p))
    _ssd_state_update_kernel[grid](
        state, state_indices if state_indices is not None else y, x, dt, A, B, C, D if D is not None else A,
        dt_bias if dt_bias is not None else A, y,
        float(dt_limit[0]), float(dt_limit[1]), num_heads // num_groups, head_dim, state_size,
        *state.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), y.stride(0), y.stride(1),
        BLOCK_P=block_p, BLOCK_N=block_n, HAS_INDICES=state_indices is not None,
        num_warps=8 if block_n >= 128 else 4, **_flags(D, dt_bias, dt_softplus),
    )
    return y
