"""Beam search as a select stage: each step, a group's ``width`` beam slots (sequences) get their
next tokens from ``BeamGroup.step``, and a slot whose new beam descends from another slot takes that
slot's KV through the cache's copy-on-write ``fork`` (shared blocks, no copy) and its tokens.

The slots never stop by themselves (``beam_slot_params``): the group ends them all at once, and
the request's output is the group's best hypotheses (``Request.beam_results``).

Structured output: each beam's logprobs are masked by its own matcher (``lmplug.constraints``)
after the log-softmax, as a transformers ``LogitsProcessor`` would mask them; a slot that takes
over another beam's tokens takes a copy of its matcher (``Constraints.fork``). A running beam
that can no longer continue (its score is -inf: the constraint forbade its token; or it ended
with a stop token, kept only because too few continuations were left) allows nothing: its
matcher is dropped and its row is -inf.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from lmplug.beam.search import BeamGroup
from lmplug.constraints import Constraints
from lmplug.errors import ConfigError
from lmplug.interfaces.constraint import apply_bitmask
from lmplug.interfaces.params import SamplingParams
from lmplug.interfaces.scheduler import ScheduledSeq, samples_now
from lmplug.interfaces.sequence import Sequence
from lmplug.kit.kv_extras import is_swapped


def is_beam(seq: Sequence) -> bool:
    return seq.params.beam_width > 0


class BeamStage:
    """The select stage of beam groups. ``requests``: the engine's ``RequestTable``."""

    def __init__(self, kv, requests, eos_token_ids: frozenset[int], max_model_len: int, tokenizer, *,
                 max_num_seqs: int, can_fork: bool, speculative: bool, constraints: Constraints | None = None,
                 ) -> None:
        self.kv = kv
        self.constraints = constraints or Constraints(None, 0)
        self._masks = None  # this step's structured-output mask job, started in plan
        self._dead: set[int] = set()  # slots (seq ids) of constrained beams that allow nothing
        # what ``admit`` checks a request against (``check_beam_request``)
        self.max_num_seqs, self.can_fork, self.speculative = max_num_seqs, can_fork, speculative
        self.requests = requests
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self._groups: dict[str, BeamGroup] = {}
        self._ready: dict[str, dict[int, torch.Tensor]] = {}  # request -> beam seq_id -> its logits row

    def claims(self, params: SamplingParams) -> bool:
        return params.beam_width > 0

    def admit(self, params: SamplingParams) -> None:
        check_beam_request(params, max_num_seqs=self.max_num_seqs, can_fork=self.can_fork,
                           speculative=self.speculative)

    def propose(self, seqs: list[Sequence]) -> dict[int, int]:
        return {}

    def plan(self, scheduled: list[ScheduledSeq]) -> None:
        """Start filling the structured-output masks of the live beams that sample this step."""
        self._masks = self.constraints.start([item.seq for item in scheduled
                                              if samples_now(item) and item.seq.seq_id not in self._dead])

    def select(self, logits: torch.Tensor, num_rows: list[int], seqs: list[Sequence],
               hidden: torch.Tensor | None = None,
               on_error: Callable[[Sequence, Exception], None] | None = None,
               ) -> tuple[list[list[int]], list[list[int]]]:
        """A group steps once every beam has its next-token logits. Beams that ran without the
        rest (chunked prefill, a preempted or not yet admitted sibling) keep their row and get no
        token yet (nothing left to compute, so the scheduler leaves them be); the step that
        completes the group appends the tokens of the beams that did not run itself."""
        last = [end - 1 for end in itertools.accumulate(num_rows)]
        filled, self._masks = self.constraints.result(self._masks), None
        tokens: list[list[int]] = [[] for _ in seqs]
        rows: list[list[int]] = [[r] for r in last]
        where = {seq.seq_id: i for i, seq in enumerate(seqs)}
        for rid in dict.fromkeys(s.request_id for s in seqs):
            slots = self.requests[rid].seqs
            try:
                rows_of = self._ready.setdefault(rid, {})
                for s in slots:
                    if s.seq_id in where:
                        rows_of[s.seq_id] = logits[last[where[s.seq_id]]].float().clone()
                if not all(s.seq_id in rows_of and self._in_cache(s) for s in slots):
                    continue  # the group waits for its other beams
                parent_seqs = list(slots)
                chosen = self._step(rid, torch.stack([rows_of.pop(s.seq_id) for s in slots]), slots, filled)
            except Exception as exc:
                if on_error is None:
                    raise
                for s in slots:
                    if s.seq_id in where:
                        on_error(s, exc)
                continue
            # after _step, the request's slots are in the new beams' order: slot k is beam k
            for slot, (parent, token) in zip(self.requests[rid].seqs, chosen):
                if slot.seq_id in where:
                    i = where[slot.seq_id]
                    src = where.get(parent_seqs[parent].seq_id)
                    tokens[i], rows[i] = [token], [last[src] if src is not None else last[i]]
                elif not slot.is_finished:
                    slot.append_token(token)  # did not run this step: no row to return it for
        return tokens, rows

    def _in_cache(self, seq: Sequence) -> bool:
        """Every token of ``seq`` is in the KV cache (not preempted, not swapped out)."""
        return not seq.is_finished and seq.num_computed_tokens == seq.num_tokens and not is_swapped(self.kv, seq)

    def _step(self, rid: str, logits: torch.Tensor, slots: list[Sequence], filled: dict,
              ) -> list[tuple[int, int]]:
        req = self.requests[rid]
        params = req.params
        max_new = params.max_tokens or (self.max_model_len - len(req.prompt_ids))
        max_new = min(max_new, self.max_model_len - len(req.prompt_ids))
        ends = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        group = self._groups.get(rid)
        if group is None:
            group = self._groups[rid] = BeamGroup(params.beam_width, params.length_penalty,
                                                  params.early_stopping, max_new, len(ends))
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if slots[0].num_output_tokens < params.min_tokens and ends:
            logprobs[:, sorted(ends)] = float("-inf")  # as transformers' MinNewTokensLength, after the softmax
        if params.structured is not None:
            self._mask(logprobs, slots, filled)
        new_len = slots[0].num_output_tokens + 1

        def stops(parent: int, token: int) -> bool:
            return (token in ends or new_len >= max_new
                    or (bool(params.stop) and self._stop_string(group.outputs[parent] + [token], params) is not None))

        chosen = group.step(logprobs, stops)
        if group.finished:
            self._finish(rid, group, slots)
        else:
            self._reorder(rid, slots, [p for p, _ in chosen])
            if params.structured is not None:
                self._mark_dead(self.requests[rid].seqs, group, [t in ends for _, t in chosen])
        return chosen

    def _mask(self, logprobs: torch.Tensor, slots: list[Sequence], filled: dict) -> None:
        """Each live beam's constraint mask on its logprobs row; dead beams' rows -inf."""
        live = [i for i, s in enumerate(slots) if s.seq_id not in self._dead]
        masks = self.constraints.assemble([slots[i] for i in live], [1] * len(live), filled)
        dead = [i for i in range(len(slots)) if i not in set(live)]
        if masks.bitmask is not None:
            apply_bitmask(logprobs, masks.bitmask, torch.tensor(live, dtype=torch.long)[masks.rows])
        logprobs[dead] = float("-inf")

    def _mark_dead(self, slots: list[Sequence], group: BeamGroup, ended: list[bool]) -> None:
        """After a step: the slots (in the new beams' order) that can no longer continue."""
        for slot, score, end in zip(slots, group.scores.tolist(), ended):
            if end or score == float("-inf"):
                self._dead.add(slot.seq_id)
                self.constraints.release(slot)
            else:
                self._dead.discard(slot.seq_id)

    def _reorder(self, rid: str, slots: list[Sequence], parents: list[int]) -> None:
        """New beam k descends from slot ``parents[k]``. A parent's first child keeps the parent's
        sequence (its KV stays where it is); each further child takes the sequence of a beam that
        was dropped, whose blocks go back at once, and forks the parent's KV into it. The
        request's slots are then in the new beams' order. No temporary sequence is needed, so a
        cache with exactly ``beam_width`` rows (contiguous) can hold a group."""
        dropped = [s for j, s in enumerate(slots) if j not in set(parents)]
        taken: set[int] = set()
        order: list[Sequence] = []
        for p in parents:
            src = slots[p]
            if p not in taken:
                taken.add(p)
                order.append(src)
                continue
            dst = dropped.pop()
            self.kv.free(dst)
            self.constraints.fork(src, dst)
            dst.fork_from(src, outputs=True)
            self.kv.fork(src, dst)
            order.append(dst)
        self.requests[rid].seqs[:] = order

    def _finish(self, rid: str, group: BeamGroup, slots: list[Sequence]) -> None:
        req = self.requests[rid]
        params = req.params
        results, finish = group.results(params.n), []
        for hyp in results:
            text = self._decode(hyp.token_ids, params)
            cut = self._stop_string(hyp.token_ids, params) if params.stop else None
            last = hyp.token_ids[-1] if hyp.token_ids else None
            if cut is not None:
                stop, at = cut
                text = text[:at + len(stop)] if params.include_stop_str_in_output else text[:at]
                finish.append(("stop", stop))
            elif last in params.stop_token_ids:
                finish.append(("stop", last))
            elif not params.ignore_eos and last in self.eos_token_ids:
                finish.append(("stop", None))
            else:
                finish.append(("length", None))
            hyp.text = text
        req.beam_results, req.beam_finish = results, finish
        for slot in slots:
            slot.finish(finish[0][0] if finish else "length")
        del self._groups[rid]
        self._ready.pop(rid, None)

    def _decode(self, token_ids: list[int], params) -> str:
        if self.tokenizer is None:
            return ""
        ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        if token_ids and token_ids[-1] in ends and not params.include_stop_str_in_output:
            token_ids = token_ids[:-1]  # a stop token ends the text; it is not part of it
        return self.tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)

    def _stop_string(self, token_ids: list[int], params) -> tuple[str, int] | None:
        text = self._decode(token_ids, params)
        hits = [(text.find(s), s) for s in params.stop if s in text]
        return None if not hits else (min(hits)[1], min(hits)[0])

    def settle(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.is_finished:
                self.release(seq)

    def release(self, seq: Sequence) -> None:
        self._groups.pop(seq.request_id, None)
        self._ready.pop(seq.request_id, None)
        self.constraints.release(seq)
        self._dead.discard(seq.seq_id)

    def stats(self) -> dict:
        return {}

    def annotate(self, outputs: list) -> None:
        pass


class BeamRequestError(ConfigError):
    """A beam request refused at admission. ``field``: the ``SamplingParams`` field to blame
    (the server names the request field it came from)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_beam_request(params, *, max_num_seqs: int, can_fork: bool, speculative: bool) -> None:
    """Refuse, naming the option, what beam search cannot do here."""
    width = params.beam_width
    if width > max_num_seqs:
        raise BeamRequestError("beam_width", f"beam_width={width} is above scheduler max_num_seqs={max_num_seqs}: "
                               "every beam of a group runs in the same step")
    if speculative:
        raise BeamRequestError("beam_width", "beam search (beam_width) does not combine with speculative decoding "
                               "(speculative.method): turn one of them off")
    if not can_fork:
        raise BeamRequestError("beam_width", "beam search (beam_width) needs a KV cache with the 'fork' or "
                               "'fork_copy' feature (the paged or contiguous cache; under tensor parallelism "
                               "also 'tp_copies'; not with state layers)")
    lossy = [name for name, on in (("presence_penalty", params.presence_penalty != 0),
                                   ("frequency_penalty", params.frequency_penalty != 0),
                                   ("repetition_penalty", params.repetition_penalty != 1),
                                   ("logit_bias", bool(params.logit_bias)), ("logprobs", params.logprobs is not None),
                                   ("prompt_logprobs", params.prompt_logprobs is not None)) if on]
    if lossy:
        raise BeamRequestError(lossy[0], f"beam search (beam_width) does not support {', '.join(lossy)}: beams "
                               "are scored by the model's own logprobs")
