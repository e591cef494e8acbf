"""Causal depthwise conv1d with a carried state, in PyTorch: the CPU path and the reference of ``conv1d_kernels``.

Mamba2 runs a depthwise (one filter per channel) causal convolution of width K
over the concatenated ``xBC`` channels, then SiLU (``nn.Conv1d(groups=C,
padding=K-1)`` truncated to the sequence, as transformers' ``Mamba2Mixer``)::

    y[t, c] = act(bias[c] + sum_{k<K} weight[c, k] * u[t - (K-1) + k, c])

where ``u`` is the sequence's input preceded by its earlier inputs. Those
earlier inputs are the *conv state*: ``conv_state [B, C, K-1]``, the last K-1
inputs of the sequence so far in time order (oldest first; zeros for a fresh
sequence, which is the zero padding of ``nn.Conv1d``). K-1 columns, not
transformers' K: the output at t reads exactly the K-1 inputs before it, so a
K-th column is never used (transformers keeps it and its conv ignores it; its
state is ours behind one extra oldest column).

- ``causal_conv1d``: prefill / chunked prefill over sequences flattened along
  dim 0 (``x [T, C]``, ``cu_seqlens [B+1]``), each preceded by its state; returns
  the outputs and each sequence's new state (a new tensor; the input state is
  left as it was), so chunks carried one after another equal one pass.
- ``causal_conv1d_update``: decode, one token per sequence; the state is rolled
  in place (oldest column out, the token in).

State slots: both take an optional ``state_indices [B]`` (int32/int64). Then
the state argument is a pool ``[num_slots, C, K-1]`` (one slot per running
sequence, as a state cache keeps them) and sequence b reads and writes row
``state_indices[b]``, in place: the prefill writes its new states into the pool
and returns None in their place, the update rolls those rows. Indices must be
distinct and in range; other rows are left alone. Without indices, nothing
changes. (``check_state_indices`` is shared by the other state ops.)

Sums are taken in fp32; outputs come back in x's dtype, states in the state's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "silu", "swish")


def check_activation(activation: str | None, what: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"{what}: activation must be one of {ACTIVATIONS}, got {activation!r}")


def sequence_positions(cu_seqlens: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cu_seqlens [B+1] -> (seq_ids [T], positions [T]): each flattened token's sequence and its
    position in that sequence (``num_tokens`` = T, a host int, spares a device sync)."""
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    seq_ids = torch.repeat_interleave(torch.arange(lens.shape[0], device=cu.device), lens,
                                      output_size=num_tokens)
    positions = torch.arange(num_tokens, device=cu.device) - cu[seq_ids]
    return seq_ids, positions


def check_state_indices(state_indices: torch.Tensor, pool: torch.Tensor | None, batch: int, what: str) -> None:
    """Raise ``ValueError`` unless ``state_indices`` is an int32/int64 ``[B]`` beside a pool to index."""
    if pool is None:
        raise ValueError(f"{what}: state_indices needs the state pool [num_slots, ...] to read and write")
    if state_indices.dim() != 1 or state_indices.shape[0] != batch or \
            state_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what}: state_indices must be int32/int64 [B] = [{batch}]; got {state_indices.dtype} "
                         f"{list(state_indices.shape)}")
    if state_indices.device != pool.device:
        raise ValueError(f"{what}: state_indices must be on the pool's device {pool.device}, got {state_indices.device}")


def _window_rows(cu: torch.Tensor, seq_ids: torch.Tensor, pos: torch.Tensor, width: int,
                 num_state_rows: int) -> torch.Tensor:
    """Rows of ``[state rows (B*(K-1)); x rows (T)]`` holding inputs ``pos - width .. pos - 1`` of
    sequences ``seq_ids``: [n, width]. Inputs before the sequence's first token come from its state."""
    j = pos[:, None] - width + torch.arange(width, device=pos.device)  # [n, width] input positions
    from_x = num_state_rows + cu[seq_ids][:, None] + j
    from_state = seq_ids[:, None] * width + width + j
    return torch.where(j >= 0, from_x, from_state)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  cu_seqlens: torch.Tensor, conv_state: torch.Tensor | None = None,
                  activation: str | None = "silu", *, state_indices: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, C], weight [C, K], bias [C] or None, cu_seqlens [B+1], conv_state [B, C, K-1] (None:
    zeros, fresh sequences) -> (y [T, C] in x's dtype, new conv_state [B, C, K-1]). With
    ``state_indices`` [B]: conv_state is the pool [num_slots, C, K-1], rows updated in place, None returned."""
    check_activation(activation, "causal_conv1d")
    num_tokens, channels = x.shape
    width = weight.shape[1] - 1
    batch = cu_seqlens.shape[0] - 1
    if state_indices is not None:
        check_state_indices(state_indices, conv_state, batch, "causal_conv1d")
        y, new_state = causal_conv1d(x, weight, bias, cu_seqlens, conv_state[state_indices], activation)
        conv_state[state_indices] = new_state
        return y, None
    if conv_state is None:
        conv_state = x.new_zeros(batch, channels, width)
    cu = cu_seqlens.long().to(x.device)
    seq_ids, pos = sequence_positions(cu, num_tokens)
    # one table of every input a window can read: the states' columns as rows, then x
    rows = torch.cat([conv_state.transpose(1, 2).reshape(batch * width, channels).float(), x.float()])
    taps = torch.cat([_window_rows(cu, seq_ids, pos, width, batch * width),
                      batch * width + torch.arange(num_tokens, device=x.device)[:, None]], dim=1)
    y = torch.einsum("tkc,ck->tc", rows[taps], weight.float())  # taps [T, K]: oldest input first
    if bias is not None:
        y = y + bias.float()
    if activation is not None:
        y = F.silu(y)
    # the new state: the K-1 inputs before position len, i.e. the last K-1 of [state; sequence]
    lens = cu[1:] - cu[:-1]
    last = _window_rows(cu, torch.arange(batch, device=x.device), lens, width, batch * width)
    new_state = rows[last].transpose(1, 2).to(conv_state.dtype)  # [B, C, K-1]
    return y.to(x.dtype), new_state


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None, activation: str | None = "silu", *,
                         state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """One token per sequence: x [B, C], conv_state [B, C, K-1] (rolled in place) -> y [B, C]. With
    ``state_indices`` [B]: conv_state is the pool [num_slots, C, K-1], rows state_indices rolled in place."""
    check_activation(activation, "causal_conv1d_update")
    if state_indices is not None:
        check_state_indices(state_indices, conv_state, x.shape[0], "causal_conv1d_update")
        rows = conv_state[state_indices]
        y = causal_conv1d_update(x, rows, weight, bias, activation)
        conv_state[state_indices] = rows
        return y
    window = torch.cat([conv_state.float(), x.float()[:, :, None]], dim=2)  # [B, C, K]
    y = (window * weight.float()).sum(dim=2)
    if bias is not None:
        y = y + bias.float()
    if activation is not None:
        y = F.silu(y)
    conv_state.copy_(window[:, :, 1:])
    return y.to(x.dtype)
