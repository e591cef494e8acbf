"""Mamba2's state space duality (SSD) scan in PyTorch: the CPU path and the reference of ``ssd_kernels``.

Per head h (``A`` a negative scalar per head), a state ``S [P, N]`` runs over
the tokens of a sequence (Dao & Gu 2024, "Transformers are SSMs", section 6)::

    dt_t = clamp(softplus(dt_t + dt_bias), *dt_limit)
    S_t  = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T          x_t [P], B_t, C_t [N]
    y_t  = S_t C_t + D x_t

B and C have G groups shared by the H heads (head h reads group h // (H/G)).
The chunked form cuts a sequence into chunks of ``chunk_size`` tokens; with
``c_l`` the running sum of ``dt A`` inside a chunk and ``S_0`` the state the
chunk starts from::

    y_l = sum_{s<=l} (C_l . B_s) exp(c_l - c_s) dt_s x_s  +  exp(c_l) S_0 C_l  +  D x_l
    S_end = exp(c_last) S_0 + sum_s exp(c_last - c_s) dt_s x_s B_s^T

the first term a masked quadratic form inside the chunk, the others the
recurrence from chunk to chunk. The chunk size changes only the rounding.

- ``ssd_chunk_scan``: prefill / chunked prefill over sequences flattened along
  dim 0 (``cu_seqlens``), each starting from its ``initial_state`` (fp32; zeros
  for a fresh sequence); returns the outputs and each final state (fp32).
  Sequences are padded into a batch to a whole number of chunks; padded steps
  have dt = 0 (no decay, no input), so they leave the final state alone.
- ``ssd_state_update``: decode, one token per sequence, state updated in place.

State slots: both take an optional ``state_indices [B]`` (int32/int64); the
state argument is then a pool ``[num_slots, H, P, N]`` fp32 and sequence b reads
and writes row ``state_indices[b]`` in place (the scan returns None for the
final states, which are in the pool), as ``conv1d_ref`` describes.

Everything is computed in fp32; outputs come back in x's dtype. transformers'
``Mamba2Mixer`` (``mamba2_chunk_scan`` / ``mamba2_selective_state_update``) is
the model this matches; its decode path does not apply ``dt_limit``, here both
paths do (a decode step then equals the prefill of the same token; the two
agree whenever the limit is the default (0, inf)).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from lmplug_mixer.conv1d_ref import check_state_indices, sequence_positions


def discretize_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool,
                  dt_limit: tuple[float, float]) -> torch.Tensor:
    """dt [..., H] -> fp32 clamp(softplus(dt + dt_bias), *dt_limit) (softplus only if asked)."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def _heads_of_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: each group repeated for its H/G heads."""
    return t.repeat_interleave(num_heads // t.shape[-2], dim=-2)


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """a [..., L] -> [..., L, L] with [l, s] = a_{s+1} + ... + a_l for s <= l, -inf above the
    diagonal. Summed directly rather than as a difference of running sums, which would cancel."""
    length = a.shape[-1]
    below = torch.ones(length, length, dtype=torch.bool, device=a.device).tril(-1)
    terms = a[..., :, None].expand(*a.shape, length).masked_fill(~below, 0.0)  # [l, s] = a_l if l > s
    causal = torch.ones(length, length, dtype=torch.bool, device=a.device).tril()
    return terms.cumsum(dim=-2).masked_fill(~causal, float("-inf"))


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor | None, cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None,
                   chunk_size: int, *, dt_bias: torch.Tensor | None = None, dt_softplus: bool = True,
                   dt_limit: tuple[float, float] = (0.0, math.inf), state_indices: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, H, P], dt [T, H], A [H], B and C [T, G, N], D [H] or None, cu_seqlens [B+1],
    initial_state [B, H, P, N] or None (zeros) -> (y [T, H, P] in x's dtype, final_state
    [B, H, P, N] fp32). With ``state_indices`` [B]: initial_state is the pool [num_slots, H, P, N]
    fp32, its rows state_indices overwritten by the final states, and None returned for them."""
    if state_indices is not None:
        check_state_indices(state_indices, initial_state, cu_seqlens.shape[0] - 1, "ssd_chunk_scan")
        y, final = ssd_chunk_scan(x, dt, A, B, C, D, cu_seqlens, initial_state[state_indices], chunk_size,
                                  dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
        initial_state[state_indices] = final
        return y, None
    num_tokens, num_heads, head_dim = x.shape
    state_size = B.shape[-1]
    batch = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.long().to(x.device)
    seq_ids, pos = sequence_positions(cu, num_tokens)
    max_len = int((cu[1:] - cu[:-1]).max()) if batch else 0
    num_chunks = max(1, -(-max_len // chunk_size))

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [T, ...] -> [B, chunks, L, ...] fp32, zero-padded
        padded = t.new_zeros(batch, num_chunks * chunk_size, *t.shape[1:], dtype=torch.float32)
        padded[seq_ids, pos] = t.float()
        return padded.view(batch, num_chunks, chunk_size, *t.shape[1:])

    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)
    xs = chunked(x)  # [b, c, l, h, p]
    dts = chunked(dt)  # [b, c, l, h]; 0 on padding
    Bs = chunked(_heads_of_groups(B, num_heads))  # [b, c, l, h, n]
    Cs = chunked(_heads_of_groups(C, num_heads))
    a = (dts * A.float()).permute(0, 1, 3, 2)  # [b, c, h, l]: log of each step's decay
    cum = a.cumsum(dim=-1)
    xdt = xs * dts[..., None]  # dt_s x_s

    # inside each chunk: the masked quadratic form
    scores = torch.einsum("bclhn,bcshn->bchls", Cs, Bs) * torch.exp(_segment_sums(a))
    y = torch.einsum("bchls,bcshp->bclhp", scores, xdt)
    # what each chunk adds to the state, decayed to the chunk's end
    to_end = torch.exp(cum[..., -1:] - cum)  # [b, c, h, l]
    chunk_states = torch.einsum("bchl,bclhp,bclhn->bchpn", to_end, xdt, Bs)
    # from chunk to chunk: the state each chunk starts from
    state = (torch.zeros(batch, num_heads, head_dim, state_size, device=x.device)
             if initial_state is None else initial_state.float().clone())
    starts = []
    for c in range(num_chunks):
        starts.append(state)
        state = state * torch.exp(cum[:, c, :, -1])[..., None, None] + chunk_states[:, c]
    start_states = torch.stack(starts, dim=1)  # [b, c, h, p, n]
    y = y + torch.einsum("bclhn,bchpn,bchl->bclhp", Cs, start_states, torch.exp(cum))
    if D is not None:
        y = y + D.float()[:, None] * xs
    y = y.reshape(batch, num_chunks * chunk_size, num_heads, head_dim)[seq_ids, pos]
    return y.to(x.dtype), state


def ssd_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                     B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None = None,
                     dt_bias: torch.Tensor | None = None, *, dt_softplus: bool = True,
                     dt_limit: tuple[float, float] = (0.0, math.inf),
                     state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """One token per sequence: state [B, H, P, N] fp32 (updated in place), x [B, H, P], dt [B, H],
    A [H], B and C [B, G, N], D [H] or None -> y [B, H, P] in x's dtype. With ``state_indices``
    [B]: state is the pool [num_slots, H, P, N], rows state_indices updated in place."""
    if state_indices is not None:
        check_state_indices(state_indices, state, x.shape[0], "ssd_state_update")
        rows = state[state_indices]
        y = ssd_state_update(rows, x, dt, A, B, C, D, dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
        state[state_indices] = rows
        return y
    num_heads = x.shape[1]
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)  # [b, h]
    xf = x.float()
    Bh = _heads_of_groups(B.float(), num_heads)  # [b, h, n]
    Ch = _heads_of_groups(C.float(), num_heads)
    decay = torch.exp(dt * A.float())[..., None, None]
    new_state = state.float() * decay + (dt[..., None] * xf)[..., None] * Bh[:, :, None, :]
    state.copy_(new_state)
    y = torch.einsum("bhpn,bhn->bhp", new_state, Ch)
    if D is not None:
        y = y + D.float()[:, None] * xf
    return y.to(x.dtype)
