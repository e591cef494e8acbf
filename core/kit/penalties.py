"""The logits-adjustment stage: penalties, ``logit_bias``, ``min_tokens`` and the constraint mask.

Both select stages (the plain sampler and the speculative verifier) run ``adjust_logits`` on
the raw logits before temperature and the top-k / top-p / min-p filters, so a greedy row takes
the argmax of the adjusted logits and a sampled row draws from them. The order, and each step's
arithmetic, is the reference one where a reference exists:

1. ``repetition_penalty`` over the distinct tokens of prompt + output (transformers'
   ``RepetitionPenaltyLogitsProcessor``: ``logit < 0 ? logit * p : logit / p``);
2. ``frequency_penalty * count`` then ``presence_penalty * (count > 0)`` subtracted, counted over
   the output only (OpenAI's definition, vLLM's arithmetic);
3. ``logit_bias`` added;
4. ``min_tokens``: until the output has that many tokens, EOS (unless ``ignore_eos``: then EOS
   ends nothing, as in vLLM) and ``stop_token_ids`` are set to -inf;
5. the structured-output bitmask (``lmplug.interfaces.constraint.apply_bitmask``); a constrained
   row left with no finite logit raises ``ValueError`` (the engine fails that request alone).

Batched and sparse: each step is one gather / scatter over a flattened ``row * V + token`` index
of all the rows that need it, so the cost follows the histories' lengths, not batch x vocabulary,
and rows that need nothing cost nothing. A prompt does not change while its sequence lives, so a
select stage keeps each one's distinct ids as a tensor (``PromptIds``) instead of packing the
prompt's Python list again at every step and for every speculative row.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from lmplug.interfaces.constraint import apply_bitmask, bitmask_words
from lmplug.interfaces.params import SamplingParams

if TYPE_CHECKING:
    from lmplug.interfaces.sequence import Sequence as Seq


class RowHistory(NamedTuple):
    """The tokens behind one logits row: the prompt, then what was generated before that row
    (for a speculative row ``j``: the output plus the first ``j`` draft tokens). The prompt may
    also be a CPU int64 tensor of its distinct ids (``PromptIds``): only the repetition penalty
    reads it, and only as a set."""

    prompt_ids: Sequence[int] | torch.Tensor
    output_ids: Sequence[int]


NO_HISTORY = RowHistory((), ())  # for rows whose params need no adjusting (their history is not read)


class PromptIds:
    """seq_id -> the sequence's distinct prompt ids (CPU int64), built on first use.

    Owned by a select stage, which calls ``release`` when the sequence ends."""

    def __init__(self) -> None:
        self._ids: dict[int, torch.Tensor] = {}

    def history(self, seq: Seq, output_ids: Sequence[int]) -> RowHistory:
        """``seq``'s prompt (cached) with ``output_ids`` as the tokens generated before the row;
        the prompt is left out (empty) where no repetition penalty would read it."""
        if seq.params.repetition_penalty == 1:
            return RowHistory((), output_ids)
        ids = self._ids.get(seq.seq_id)
        if ids is None:
            ids = self._ids[seq.seq_id] = torch.tensor(seq.prompt_token_ids, dtype=torch.long).unique()
        return RowHistory(ids, output_ids)

    def release(self, seq: Seq) -> None:
        self._ids.pop(seq.seq_id, None)


NO_TOKEN_LEFT = "the structured-output constraint allows no token at this position"


def adjust_logits(logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[RowHistory],
                  eos_token_ids: frozenset[int] | Sequence[int] = frozenset(),
                  bitmask: torch.Tensor | None = None,
                  bitmask_rows: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
    """logits [N, V] -> adjusted float32 copy [N, V]; the caller's tensor is never modified.

    ``params[i]`` and ``histories[i]`` belong to row ``i``; ``histories[i]`` is read only when
    ``params[i].needs_adjusting`` (``NO_HISTORY`` may stand in for the others). ``bitmask`` int32
    [M, W] (``constraint.new_bitmask``) applies to rows ``bitmask_rows`` (None: M == N, row i to
    row i); words missing past ``W * 32`` forbid those tokens (ids beyond the tokenizer's
    vocabulary). With nothing to adjust and no bitmask, the input itself comes back as float32.
    """
    logits = logits.float()
    num_rows, vocab = logits.shape
    if len(params) != num_rows or len(histories) != num_rows:
        raise ValueError(f"adjust_logits: {num_rows} logits rows need as many params and histories, "
                         f"got {len(params)} and {len(histories)}")
    active = [i for i, p in enumerate(params) if p.needs_adjusting]
    if not active and bitmask is None:
        return logits
    out = logits.clone(memory_format=torch.contiguous_format)
    flat = out.view(-1)
    rep = [i for i in active if params[i].repetition_penalty != 1]
    if rep:
        _repetition(flat, vocab, rep, params, histories)
    counted = [i for i in active if params[i].frequency_penalty != 0 or params[i].presence_penalty != 0]
    if counted:
        _frequency_presence(flat, vocab, counted, params, histories)
    biased = [i for i in active if params[i].logit_bias]
    if biased:
        _logit_bias(flat, vocab, biased, params)
    blocked = _min_tokens_blocked(vocab, active, params, histories, eos_token_ids)
    if blocked:
        index = _flat_index([(i, ids) for i, ids in blocked.items()], vocab, out.device)
        flat[index] = float("-inf")
    if bitmask is not None:
        _mask(out, bitmask, bitmask_rows, params, blocked)
    return out


def _flat_index(rows: list[tuple[int, Sequence[int]]], vocab: int, device: torch.device) -> torch.Tensor:
    """``row * vocab + token`` for every (row, token) pair, in order."""
    packed = array.array("q", itertools.chain.from_iterable(ids for _, ids in rows))  # ~4x torch.tensor(list)
    if not packed:
        return torch.empty(0, dtype=torch.long, device=device)
    return _row_major(torch.frombuffer(packed, dtype=torch.long), [r for r, _ in rows],
                      [len(ids) for _, ids in rows], vocab, device)


def _row_major(ids: torch.Tensor, rows: list[int], lengths: list[int], vocab: int,
               device: torch.device) -> torch.Tensor:
    """``row * vocab + id`` for ``ids`` laid out row after row (``lengths[k]`` ids of ``rows[k]``),
    ids outside [0, vocab) dropped (a prompt may hold ids of an embedding larger than the LM
    head; the head cannot emit them)."""
    row_of = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long),
                                     torch.tensor(lengths, dtype=torch.long))
    keep = (ids >= 0) & (ids < vocab)
    return (row_of[keep] * vocab + ids[keep]).to(device, non_blocking=True)


def _per_element(index: torch.Tensor, vocab: int, rows: list[int], values: list[float]) -> torch.Tensor:
    """Each flat index's row's value (float32), for per-row factors applied to scattered tokens."""
    table = torch.zeros(max(rows) + 1, dtype=torch.float32)
    table[torch.tensor(rows)] = torch.tensor(values, dtype=torch.float32)
    return table.to(index.device)[index // vocab]


def _repetition(flat: torch.Tensor, vocab: int, rows: list[int], params: Sequence[SamplingParams],
                histories: Sequence[RowHistory]) -> None:
    # the set of (row, token) in prompt or output; cached prompts (PromptIds) join as tensors
    prompts = [(i, histories[i].prompt_ids) for i in rows]
    cached = [(i, ids) for i, ids in prompts if isinstance(ids, torch.Tensor)]
    listed = [(i, ids) for i, ids in prompts if not isinstance(ids, torch.Tensor)]
    index = _flat_index(listed + [(i, histories[i].output_ids) for i in rows], vocab, flat.device)
    if cached:
        ids = torch.cat([t for _, t in cached])
        index = torch.cat([index, _row_major(ids, [i for i, _ in cached], [t.numel() for _, t in cached],
                                             vocab, flat.device)])
    index = index.unique()
    penalty = _per_element(index, vocab, rows, [params[i].repetition_penalty for i in rows])
    seen = flat[index]
    flat[index] = torch.where(seen < 0, seen * penalty, seen / penalty)


def _frequency_presence(flat: torch.Tensor, vocab: int, rows: list[int], params: Sequence[SamplingParams],
                        histories: Sequence[RowHistory]) -> None:
    index, counts = _flat_index([(i, histories[i].output_ids) for i in rows], vocab, flat.device) \
        .unique(return_counts=True)
    if index.numel() == 0:
        return
    frequency = _per_element(index, vocab, rows, [params[i].frequency_penalty for i in rows])
    presence = _per_element(index, vocab, rows, [params[i].presence_penalty for i in rows])
    values = flat[index]
    values -= frequency * counts.float()
    values -= presence  # every gathered token occurs at least once
    flat[index] = values


def _logit_bias(flat: torch.Tensor, vocab: int, rows: list[int], params: Sequence[SamplingParams]) -> None:
    for i in rows:
        bad = [t for t in params[i].logit_bias if t >= vocab]
        if bad:
            raise ValueError(f"SamplingParams.logit_bias has token id {bad[0]}, but the logits have {vocab} "
                             f"tokens (ids 0..{vocab - 1})")
    index = _flat_index([(i, list(params[i].logit_bias)) for i in rows], vocab, flat.device)
    bias = torch.tensor([b for i in rows for b in params[i].logit_bias.values()], dtype=torch.float32)
    flat[index] += bias.to(flat.device)  # each (row, token) once: no accumulation needed


def _min_tokens_blocked(vocab: int, active: list[int], params: Sequence[SamplingParams],
                        histories: Sequence[RowHistory], eos_token_ids) -> dict[int, list[int]]:
    """Row -> the token ids ``min_tokens`` blocks there (rows whose output is still too short)."""
    blocked = {}
    for i in active:
        p = params[i]
        if len(histories[i].output_ids) < p.min_tokens:
            ids = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | set(eos_token_ids)
            ids = sorted(t for t in ids if t < vocab)
            if ids:
                blocked[i] = ids
    return blocked


def _mask(out: torch.Tensor, bitmask: torch.Tensor, bitmask_rows, params: Sequence[SamplingParams],
          blocked: dict[int, list[int]]) -> None:
    """Apply the constraint bitmask; a masked row with nothing left raises ``ValueError``."""
    words = bitmask_words(out.shape[-1])
    if bitmask.shape[-1] < words:  # tokens past the tokenizer's vocabulary: never allowed
        bitmask = torch.nn.functional.pad(bitmask, (0, words - bitmask.shape[-1]), value=0)
    rows = None if bitmask_rows is None else torch.as_tensor(bitmask_rows, dtype=torch.long)
    if (out.shape[0] if rows is None else rows.numel()) != bitmask.shape[0]:
        raise ValueError(f"adjust_logits: {bitmask.shape[0]} bitmask rows for "
                         f"{out.shape[0] if rows is None else rows.numel()} logits rows")
    apply_bitmask(out, bitmask, rows)
    checked = out if rows is None else out[rows.to(out.device)]
    alive = torch.isfinite(checked).any(-1).tolist()
    if all(alive):
        return
    dead = alive.index(False)
    row = dead if rows is None else int(rows[dead])
    reason = NO_TOKEN_LEFT
    if row in blocked:
        reason += (f" (min_tokens={params[row].min_tokens} blocks EOS and the stop tokens until "
                   f"{params[row].min_tokens} tokens are out)")
    raise ValueError(reason)
