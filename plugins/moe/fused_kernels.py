"""Fused MoE experts in Triton: tokens grouped by expert, the SwiGLU experts as two grouped GEMMs.

What: for every (token, slot) pair ``p = t * k + j`` routed to expert ``e = ids[t, j]``,

    h[p]   = silu(x[t] @ W_gate[e]^T) * (x[t] @ W_up[e]^T)      # [I]
    y[p]   = weights[t, j] * (h[p] @ W_down[e]^T)               # [h]
    out[t] = sum_j y[t * k + j]

Why it is fast: ``moe_align_block_size`` sorts the pairs by expert and pads each
expert's run to a multiple of ``BLOCK_M`` (the idea of vLLM's kernel of that
name), so every ``BLOCK_M`` rows of the sorted order belong to one expert.
A program then computes one ``[BLOCK_M, BLOCK_N]`` tile of one expert's
product: an ordinary tiled GEMM whose A rows are gathered through the sorted
pair ids. All experts run in one launch per GEMM, with no Python loop over
experts and no per-expert launches; experts without a token own no block.
The gate/up kernel keeps both accumulators and applies SiLU-and-multiply
before storing, so the ``[pairs, 2I]`` gate/up product never reaches memory.
Padding rows carry the sentinel ``num_pairs`` and are masked out; blocks past
the padded total exit at once, so the grid can be sized without a host sync.

Launches come from a table per architecture (``moe_config``, keyed by
``lmplug.kit.devices.capability`` and the rows per expert): 16-row
blocks for decode, up to 64 (sm_80) or 128 (sm_90, 8 warps) for prefill; None
(the interpreter) keeps the small tiles the tests run. A table, not
``triton.autotune``: deterministic, nothing benchmarked at the first call,
every entry compile-checked for sm_80 and sm_90 without a GPU (spill-free
there). Offsets: the expert base (expert x N x K) and the row bases (pair or
token x stride) are 64-bit; inside one expert's weight 32-bit offsets suffice
(``fused_experts`` checks an expert has fewer than 2^31 elements).

The PyTorch twin is ``lmplug_moe.reference.reference_experts``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from lmplug_moe.reference import check_experts_args

from lmplug.kit.devices import capability


@triton.jit
def _sorted_block(sorted_pairs_ptr, block_experts_ptr, num_pairs, pid_m, TOP_K: tl.constexpr,
                  BLOCK_M: tl.constexpr):
    """The expert of block ``pid_m`` and its rows: (expert, pair ids, token ids, row mask)."""
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = pairs < num_pairs  # padding rows hold the sentinel num_pairs
    return expert, pairs, pairs // TOP_K, row_mask


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, w_ptr, h_ptr, sorted_pairs_ptr, block_experts_ptr, num_padded_ptr,
    num_pairs, hidden, inter,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wk, stride_hp, stride_hn,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """h[pairs, n-tile] = silu(x[tokens] @ W_gate[e]^T) * (x[tokens] @ W_up[e]^T)."""
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and BLOCK_K >= 16)  # tl.dot's minimum tile
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert, pairs, tokens, row_mask = _sorted_block(sorted_pairs_ptr, block_experts_ptr, num_pairs,
                                                    pid_m, TOP_K, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < inter
    a_rows = x_ptr + tokens[:, None] * stride_xt  # [BM, 1], 64-bit (tokens are int64)
    w_e = w_ptr + expert * stride_we  # expert x 2I x h passes 2^31: a 64-bit base
    # W_gate[e]^T tile [BK, BN] as 32-bit offsets inside the expert (64-bit pointer tensors of
    # both tiles kept across the loop spill); the up rows start `inter` rows further down
    w_offs = offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    up = inter * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = offs_k < hidden - k0
        a = tl.load(a_rows + (k0 + offs_k)[None, :] * stride_xh, mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        w_k = w_e + k0 * stride_wk
        acc_gate = tl.dot(a, tl.load(w_k + w_offs, mask=w_mask, other=0.0), acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, tl.load(w_k + up + w_offs, mask=w_mask, other=0.0), acc_up, input_precision=PRECISION)
    h = acc_gate * tl.sigmoid(acc_gate) * acc_up
    h_ptrs = h_ptr + pairs[:, None] * stride_hp + offs_n[None, :] * stride_hn
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _moe_down_kernel(
    h_ptr, w_ptr, y_ptr, weights_ptr, sorted_pairs_ptr, block_experts_ptr, num_padded_ptr,
    num_pairs, hidden, inter,
    stride_hp, stride_hk, stride_we, stride_wn, stride_wk, stride_yp, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """y[pairs, n-tile] = weight[pairs] * (h[pairs] @ W_down[e]^T)."""
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and BLOCK_K >= 16)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    # h rows are indexed by pair, not token: TOP_K = 1
    expert, pairs, _, row_mask = _sorted_block(sorted_pairs_ptr, block_experts_ptr, num_pairs,
                                               pid_m, 1, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < hidden
    a_rows = h_ptr + pairs[:, None] * stride_hp  # [BM, 1], 64-bit
    w_e = w_ptr + expert * stride_we
    w_offs = offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BK, BN] inside the expert
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_mask = offs_k < inter - k0
        a = tl.load(a_rows + (k0 + offs_k)[None, :] * stride_hk, mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        b = tl.load(w_e + k0 * stride_wk + w_offs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    route_w = tl.load(weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)
    acc = acc * route_w[:, None]
    y_ptrs = y_ptr + pairs[:, None] * stride_yp + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


# -- grouping and launch ------------------------------------------------------------------------------

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def moe_align_block_size(expert_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the pairs of ``expert_ids`` [T, k] by expert, each run padded to ``block_m`` rows.

    Returns ``sorted_pairs`` int32 [P] (pair ids ``t * k + j``; padding holds ``T * k``),
    ``block_experts`` int32 [P / block_m] (the expert of each block; blocks past the end
    hold ``num_experts``) and ``num_padded`` int32 [1] (rows in use). ``P`` is an upper
    bound known without reading the ids, so nothing waits for the device.
    """
    flat = expert_ids.reshape(-1).long()  # [N]
    num_pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]; out-of-range ids raise here
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)  # pair ids grouped by expert
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    # at most min(N, E) experts own tokens, each wasting fewer than block_m rows
    max_blocks = triton.cdiv(num_pairs + min(num_pairs, num_experts) * (block_m - 1), block_m)
    sorted_pairs = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[(ends - padded)[sorted_experts] + rank] = order.to(torch.int32)
    blocks = torch.arange(max_blocks, device=device)
    block_experts = torch.searchsorted(ends // block_m, blocks, right=True).to(torch.int32)
    return sorted_pairs, block_experts, ends[-1:].to(torch.int32)


def _check(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
           w_down: torch.Tensor) -> None:
    what = "fused_experts"
    check_experts_args(x, expert_ids, weights, w_gate_up, w_down, what)
    if x.dtype not in DTYPES or w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise ValueError(f"{what}: x, w_gate_up and w_down must share one of float32, float16, bfloat16; got "
                         f"{x.dtype}, {w_gate_up.dtype}, {w_down.dtype}")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if w.shape[1] * w.stride(1) + w.shape[2] * w.stride(2) >= 2**31:
            raise ValueError(f"{what}: one expert of {name} {tuple(w.shape)} spans 2^31 elements or more; "
                             "the kernels address inside an expert with 32-bit offsets")
    devices = {t.device for t in (x, expert_ids, weights, w_gate_up, w_down)}
    if len(devices) != 1:
        raise ValueError(f"{what}: all tensors must be on one device, got {sorted(map(str, devices))}")


def check_block_m(block_m: int) -> None:
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"fused_experts: block_m must be a power of two >= 16, got {block_m}")


@dataclass(frozen=True)
class MoELaunch:
    """One ``fused_experts`` call's tiles: rows per block, N tiles of each GEMM, the K step, warps
    and pipelining stages."""

    block_m: int
    block_n_gate_up: int
    block_n_down: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# per architecture and block_m: (block_n gate/up, block_n down, block_k, warps, stages). The gate/up
# kernel holds two fp32 accumulators, so its N tile stays at 64 for 128-row blocks. sm80 entries
# keep a stage's tiles small enough for ~100 KiB of shared memory (sm_86/sm_89 too).
MOE_TABLE: dict[str, dict[int, tuple[int, int, int, int, int]]] = {
    "sm80": {16: (64, 64, 64, 4, 4), 32: (64, 64, 64, 4, 4), 64: (64, 128, 32, 4, 3),
             128: (64, 128, 32, 8, 3)},
    "sm90": {16: (64, 128, 128, 4, 4), 32: (64, 128, 64, 4, 4), 64: (64, 128, 64, 4, 4),
             128: (64, 128, 64, 8, 4)},
}
MAX_BLOCK_M = {None: 64, "sm80": 64, "sm90": 128}  # what pick_block_m grows to for prefill


def arch_key(cap: tuple[int, int] | None) -> str | None:
    """The table column: None (interpreter / no GPU), ``"sm80"`` (Ampere, Ada) or ``"sm90"`` (Hopper+)."""
    if cap is None:
        return None
    return "sm90" if cap >= (9, 0) else "sm80"


def pick_block_m(num_pairs: int, num_experts: int, cap: tuple[int, int] | None = None) -> int:
    """Rows per block: small when experts get few tokens each (decode), so padding stays small;
    large for prefill where the architecture can feed it."""
    per_expert = num_pairs / num_experts
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64 if per_expert <= 256 else 128
    return min(block_m, MAX_BLOCK_M[arch_key(cap)])


def _tile(size: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(size)))


def moe_config(cap: tuple[int, int] | None, num_pairs: int, num_experts: int, hidden: int, inter: int,
               block_m: int | None = None, fp32: bool = False) -> MoELaunch:
    """The launch of ``fused_experts`` on ``cap`` (None: the interpreter's small tiles); ``block_m``
    given (the backend's option) overrides the rows per block. ``fp32``: float32 experts, whose
    exact dot runs on FMA units with twice the bytes per operand: half the K step."""
    arch = arch_key(cap)
    block_m = block_m or pick_block_m(num_pairs, num_experts, cap)
    if arch is None:
        return MoELaunch(block_m, _tile(inter, 64), _tile(hidden, 64), _tile(min(hidden, inter), 64))
    bn_gate_up, bn_down, bk, warps, stages = MOE_TABLE[arch][min(block_m, 128)]
    if fp32:
        bk = max(16, bk // 2)
    return MoELaunch(block_m, _tile(inter, bn_gate_up), _tile(hidden, bn_down), _tile(min(hidden, inter), bk),
                     warps, stages)


def fused_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                  w_down: torch.Tensor, *, block_m: int | None = None) -> torch.Tensor:
    """x [T, h]; expert_ids, weights [T, k]; w_gate_up [E, 2I, h]; w_down [E, h, I] -> [T, h] (x's dtype)."""
    _check(x, expert_ids, weights, w_gate_up, w_down)
    if block_m is not None:
        check_block_m(block_m)
    num_tokens, top_k = expert_ids.shape
    num_pairs, num_experts = num_tokens * top_k, w_gate_up.shape[0]
    if num_pairs == 0:
        return torch.zeros_like(x)
    hidden, inter = x.shape[1], w_down.shape[2]
    cfg = moe_config(capability(x.device), num_pairs, num_experts, hidden, inter, block_m,
                     fp32=x.dtype == torch.float32)
    sorted_pairs, block_experts, num_padded = moe_align_block_size(expert_ids, num_experts, cfg.block_m)
    num_blocks = block_experts.shape[0]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 must not drop to tf32 on GPUs
    launch = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}

    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # [T*k, I]
    bn = cfg.block_n_gate_up
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(inter, bn))](
        x, w_gate_up, h, sorted_pairs, block_experts, num_padded, num_pairs, hidden, inter,
        x.stride(0), x.stride(1), *w_gate_up.stride(), *h.stride(),
        TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=bn, BLOCK_K=cfg.block_k, PRECISION=precision, **launch)

    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # [T*k, h]
    flat_weights = weights.reshape(-1).contiguous()  # [T*k]
    bn = cfg.block_n_down
    _moe_down_kernel[(num_blocks, triton.cdiv(hidden, bn))](
        h, w_down, y, flat_weights, sorted_pairs, block_experts, num_padded, num_pairs, hidden, inter,
        *h.stride(), *w_down.stride(), *y.stride(),
        BLOCK_M=cfg.block_m, BLOCK_N=bn, BLOCK_K=cfg.block_k, PRECISION=precision, **launch)
    return y.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)  # [T, h]
