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

The PyTorch twin is ``lmplug_moe.reference.reference_experts``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lmplug_moe.reference import check_experts_args


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
    a_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xh  # [BM, BK]
    # W_gate[e]^T tile [BK, BN]; the up rows start `inter` rows further down
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    u_ptrs = g_ptrs + inter * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = offs_k < hidden - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        acc_gate = tl.dot(a, tl.load(g_ptrs, mask=w_mask, other=0.0), acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, tl.load(u_ptrs, mask=w_mask, other=0.0), acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_xh
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
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
    a_ptrs = h_ptr + pairs[:, None] * stride_hp + offs_k[None, :] * stride_hk  # [BM, BK]
    b_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_mask = offs_k < inter - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_hk
        b_ptrs += BLOCK_K * stride_wk
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
    devices = {t.device for t in (x, expert_ids, weights, w_gate_up, w_down)}
    if len(devices) != 1:
        raise ValueError(f"{what}: all tensors must be on one device, got {sorted(map(str, devices))}")


def check_block_m(block_m: int) -> None:
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"fused_experts: block_m must be a power of two >= 16, got {block_m}")


def pick_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: small when experts get few tokens each (decode), so padding stays small."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def _tile(size: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(size)))


def fused_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                  w_down: torch.Tensor, *, block_m: int | None = None) -> torch.Tensor:
    """x [T, h]; expert_ids, weights [T, k]; w_gate_up [E, 2I, h]; w_down [E, h, I] -> [T, h] (x's dtype)."""
    _check(x, expert_ids, weights, w_gate_up, w_down)
    num_tokens, top_k = expert_ids.shape
    num_pairs, num_experts = num_tokens * top_k, w_gate_up.shape[0]
    block_m = block_m or pick_block_m(num_pairs, num_experts)
    check_block_m(block_m)
    if num_pairs == 0:
        return torch.zeros_like(x)
    hidden, inter = x.shape[1], w_down.shape[2]
    sorted_pairs, block_experts, num_padded = moe_align_block_size(expert_ids, num_experts, block_m)
    num_blocks = block_experts.shape[0]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 must not drop to tf32 on GPUs

    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # [T*k, I]
    bn, bk = _tile(inter, 64), _tile(hidden, 64)
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(inter, bn))](
        x, w_gate_up, h, sorted_pairs, block_experts, num_padded, num_pairs, hidden, inter,
        x.stride(0), x.stride(1), *w_gate_up.stride(), *h.stride(),
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, PRECISION=precision)

    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # [T*k, h]
    flat_weights = weights.reshape(-1).contiguous()  # [T*k]
    bn, bk = _tile(hidden, 64), _tile(inter, 64)
    _moe_down_kernel[(num_blocks, triton.cdiv(hidden, bn))](
        h, w_down, y, flat_weights, sorted_pairs, block_experts, num_padded, num_pairs, hidden, inter,
        *h.stride(), *w_down.stride(), *y.stride(),
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, PRECISION=precision)
    return y.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)  # [T, h]
