"""Run a scheduler the way ``LLMEngine.step`` does, with a fake model, checking every step.

The "model" computes nothing: the runner records in the KV cache which
token sits at each position (through the block table, as real attention
would write K/V), and the next token of a sequence is a fixed function of its
tokens so far. Before "computing" new tokens, the harness reads the
sequence's cached context back: a scheduler that lets a sequence continue
from KV that was freed (preemption without recompute) or never written is
caught at that step, and outputs must equal the function's own continuation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from lmplug.api import KVCacheBackend, Scheduler, SchedulerOutput
from lmplug.interfaces.params import SamplingParams
from lmplug.interfaces.sequence import Sequence
from lmplug.kit.kv_layout import kv_slots_list
from lmplug.outputs.stopping import check_stop
from lmplug.testing.fakes import SchedulerViolation

VOCAB = 997


def next_token(tokens: list[int]) -> int:
    """The fake model: a deterministic function of the whole context."""
    h = len(tokens)
    for t in tokens:
        h = (h * 31 + t) % VOCAB
    return h + 1


def expected_output(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    tokens = list(prompt)
    while len(tokens) - len(prompt) < max_tokens and len(tokens) < max_model_len:
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    n: int = 1


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[Request, ...]
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_blocks: int  # of the fake paged KV cache
    block_size: int = 4
    needs: frozenset[str] = frozenset()

    def describe(self) -> str:
        return (
            f"{len(self.requests)} requests, max_num_seqs={self.max_num_seqs}, max_num_batched_tokens="
            f"{self.max_num_batched_tokens}, max_model_len={self.max_model_len}, KV: {self.num_blocks} "
            f"blocks of {self.block_size}"
        )


def random_requests(
    seed: int,
    count: int,
    prompt_lens: tuple[int, int],
    max_tokens: tuple[int, int],
    n_every: int = 0,
) -> tuple[Request, ...]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt = tuple(rng.randrange(1, VOCAB) for _ in range(rng.randint(*prompt_lens)))
        n = 2 if n_every and i % n_every == n_every - 1 else 1
        out.append(Request(f"req-{i}", prompt, rng.randint(*max_tokens), n))
    return tuple(out)


@dataclass
class Harness:
    scheduler: Scheduler
    kv: KVCacheBackend
    workload: Workload
    label: str
    seqs: list[Sequence] = field(default_factory=list)
    aborted: set[int] = field(default_factory=set)
    num_steps: int = 0
    num_preempted: int = 0
    _stalls: int = 0

    def add_requests(self) -> None:
        for req in self.workload.requests:
            params = SamplingParams(
                n=req.n, max_tokens=req.max_tokens, temperature=0, ignore_eos=True
            )
            for i in range(req.n):
                seq = Sequence(req.request_id, list(req.prompt), params, index=i)
                self.seqs.append(seq)
                self.scheduler.add(seq)

    def violation(self, message: str) -> SchedulerViolation:
        return SchedulerViolation(
            f"{self.label}, workload {self.workload.name!r} "
            f"({self.workload.describe()}), step {self.num_steps}: {message}"
        )

    # -- one engine step ---------------------------------------------------------------------------
    def step(self) -> None:
        self.num_steps += 1
        plan = self.scheduler.schedule()
        self._check_plan(plan)
        self.num_preempted += len(plan.preempted)
        finished = []
        for item in plan.scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            self._check_context(seq, start)
            self._write(seq, start, start + item.num_new_tokens)
            seq.advance(item.num_new_tokens)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(next_token(seq.token_ids))
                if check_stop(seq, seq.token_ids[-1], frozenset(), self.workload.max_model_len):
                    seq.finish()
                    finished.append(seq)
        self.scheduler.update(finished)

    def run(self, abort_at: dict[int, list[str]] | None = None) -> None:
        limit = 100 + 4 * sum((len(r.prompt) + r.max_tokens) * r.n for r in self.workload.requests)
        while self.scheduler.has_unfinished():
            if self.num_steps >= limit:
                raise self.violation(
                    f"requests still unfinished after {limit} steps "
                    f"({self.scheduler.num_waiting} waiting, {self.scheduler.num_running} running)"
                )
            for request_id in (abort_at or {}).get(self.num_steps, []):
                self.abort(request_id)
            self.step()

    def abort(self, request_id: str) -> None:
        expected = {s.seq_id for s in self.seqs if s.request_id == request_id and not s.is_finished}
        returned = self.scheduler.abort(request_id)
        got = {s.seq_id for s in returned or []}
        if got != expected:
            raise self.violation(
                f"abort({request_id!r}) returned sequences {sorted(got)}; the request's "
                f"unfinished sequences are {sorted(expected)}"
            )
        self.aborted |= expected
        for seq in self.seqs:  # as LLMEngine.abort_request does
            if seq.seq_id in expected and not seq.is_finished:
                seq.finish("abort")

    # -- checks ------------------------------------------------------------------------------------
    def _check_plan(self, plan: SchedulerOutput) -> None:
        w = self.workload
        if not isinstance(plan, SchedulerOutput):
            raise self.violation(
                f"schedule() returned {type(plan).__name__}, not a SchedulerOutput"
            )
        items = plan.scheduled
        if len(items) > w.max_num_seqs:
            raise self.violation(
                f"{len(items)} sequences scheduled, but max_num_seqs is {w.max_num_seqs}"
            )
        if plan.num_tokens > w.max_num_batched_tokens:
            per_seq = ", ".join(f"seq {i.seq.seq_id}: {i.num_new_tokens}" for i in items)
            raise self.violation(
                f"{plan.num_tokens} new tokens scheduled, but max_num_batched_tokens is "
                f"{w.max_num_batched_tokens} ({per_seq})"
            )
        seen: set[int] = set()
        for item in items:
            self._check_item(item, seen, {s.seq_id for s in plan.preempted})
        self._stalls = 0 if items else self._stalls + 1
        if self._stalls > 3:
            raise self.violation(
                f"schedule() returned nothing {self._stalls} times in a row while "
                f"{self.scheduler.num_waiting} sequences wait and {self.scheduler.num_running} "
                f"run (KV usage {self.kv.usage:.2f}): no progress"
            )

    def _check_item(self, item, seen: set[int], preempted: set[int]) -> None:
        seq, n = item.seq, item.num_new_tokens
        if seq.seq_id in seen:
            raise self.violation(f"{seq!r} scheduled twice in one step")
        seen.add(seq.seq_id)
        if seq.is_finished or seq.seq_id in self.aborted:
            raise self.violation(f"{seq!r} scheduled although it finished or was aborted")
        if seq.seq_id in preempted:
            raise self.violation(f"{seq!r} is both scheduled and preempted")
        if not (isinstance(n, int) and 1 <= n <= seq.num_tokens - seq.num_computed_tokens):
            raise self.violation(
                f"{seq!r} scheduled for {n} new tokens; it has "
                f"{seq.num_tokens - seq.num_computed_tokens} uncomputed"
            )
        slots = len(self.kv.block_table(seq)) * self.kv.block_size
        if slots < seq.num_computed_tokens + n:
            raise self.violation(
                f"{seq!r} scheduled up to token {seq.num_computed_tokens + n}, but the KV "
                f"cache holds only {slots} slots for it: allocate before scheduling"
            )

    def _slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        return torch.tensor(kv_slots_list(self.kv.block_table(seq), range(start, end), self.kv.block_size))

    def _write(self, seq: Sequence, start: int, end: int) -> None:
        k = self.kv.layer_view(0).k_cache
        rows = torch.tensor([[seq.token_ids[p], p] for p in range(start, end)], dtype=k.dtype)
        k.view(-1, *k.shape[2:])[self._slots(seq, start, end).to(k.device), 0, :2] = rows.to(
            k.device
        )

    def _check_context(self, seq: Sequence, upto: int) -> None:
        if upto == 0:
            return
        k = self.kv.layer_view(0).k_cache
        got = k.view(-1, *k.shape[2:])[self._slots(seq, 0, upto).to(k.device), 0, :2].cpu()
        want = torch.tensor([[seq.token_ids[p], p] for p in range(upto)], dtype=got.dtype)
        bad = ~(got == want).all(dim=1)
        if bad.any():
            p = int(bad.nonzero()[0])
            raise self.violation(
                f"{seq!r} continues from {upto} computed tokens, but its KV at position {p} holds "
                f"{_describe(got[p])}, not token {seq.token_ids[p]}: it was freed or never written "
                f"(a preempted sequence must be recomputed: reset num_computed_tokens)"
            )

    def check_done(self) -> None:
        s = self.scheduler
        if s.has_unfinished() or s.num_waiting or s.num_running:
            raise self.violation(
                f"finished, yet num_waiting={s.num_waiting}, num_running={s.num_running}"
            )
        for seq in self.seqs:
            if seq.seq_id in self.aborted:
                continue
            want = expected_output(
                seq.prompt_token_ids, seq.params.max_tokens, self.workload.max_model_len
            )
            if not seq.is_finished or seq.output_token_ids != want:
                raise self.violation(
                    f"{seq!r} output {seq.output_token_ids} differs from the fake model's "
                    f"{want} (status {seq.status.value})"
                )
        if self.kv.usage != 0:
            raise self.violation(
                f"every request finished or was aborted, but KV usage is {self.kv.usage:.3f} "
                f"(expected 0): some sequence's KV was never freed"
            )


def _describe(row: torch.Tensor) -> str:
    if torch.isnan(row).any():
        return "nothing (never written)"
    return f"token {int(row[0])} written for position {int(row[1])}"
