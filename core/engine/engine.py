"""``LLMEngine``: the loop. Each step: schedule -> run -> select -> commit.

The stages live elsewhere: the scheduler plugin picks the work, ``ModelRunner`` runs the
forward, the select stage (``select.Sampler``, or ``lmplug.speculation.Speculator`` with a
drafter) picks the tokens, and ``lmplug.outputs`` appends them, checks stops and builds
what callers receive.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq

from lmplug.beam.route import SelectRouter
from lmplug.beam.stage import BeamStage, check_beam_request
from lmplug.config import ResolvedConfig
from lmplug.constraints import Constraints
from lmplug.engine.build import EngineParts, build_engine_parts
from lmplug.engine.isolation import Observers, StepFailures
from lmplug.engine.select import Sampler
from lmplug.interfaces.params import SamplingParams, check_token_ids
from lmplug.interfaces.scheduler import ScheduledSeq, SchedulerOutput
from lmplug.interfaces.sequence import Sequence, SequenceStatus
from lmplug.outputs import RequestOutput, RequestTable
from lmplug.outputs.logprobs import record_prompt_logprobs
from lmplug.plugins import Registry, get_registry
from lmplug.speculation import Speculator

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, resolved: ResolvedConfig, registry: Registry | None = None) -> None:
        self.registry = registry or get_registry()
        self.resolved = resolved
        self.config = resolved.config
        self.registry.hook.lmplug_configure(config=self.config)
        # tensor parallelism: rank 0 (this process) starts the workers, then every rank builds its shard
        self.parallel = None
        if self.config.parallel.tensor_parallel_size > 1:
            from lmplug.engine.build import peek_model_config
            from lmplug.parallel.setup import start

            self.parallel = start(resolved, peek_model_config, build_engine_parts)
        try:
            parts: EngineParts = build_engine_parts(
                resolved, parallel=None if self.parallel is None else self.parallel.state, group=self.parallel)
        except BaseException:
            self.close()
            raise
        self.parts = parts
        self.resolved = parts.plan.resolved  # the plan's: every backend chosen for this model
        self.memory = parts.memory  # weight bytes and KV bytes/token per tensor-parallel rank
        self.model_config = parts.model_config
        self.tokenizer = parts.tokenizer
        self.kv = parts.kv
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.max_model_len = parts.max_model_len
        self.eos_token_ids = parts.eos_token_ids
        self.constraints = Constraints(parts.constraint, self.model_config.vocab_size)
        self.speculator = None if parts.drafter is None else Speculator(
            parts.drafter, parts.drafter.options.num_tokens, self.kv, self.max_model_len,
            self.constraints, self.eos_token_ids, rule=parts.acceptance)
        self.selector = self.speculator or Sampler(self.constraints, self.eos_token_ids)
        # n > 1 shares the prompt's KV when the cache and the scheduler both declare "fork"
        # (not under tensor parallelism: a fork's copy-on-write block copies happen in rank 0's pool only;
        # not with state layers: a fork takes a state slot at once, and forks can outnumber
        # max_num_seqs, the slots the pool has, so each sample runs as its own sequence)
        can_fork = (self.parallel is None and "fork" in self.kv.capabilities.features
                    and "fork" in self.scheduler.capabilities.features and not self.kv.spec.states)
        self.requests = RequestTable(self.tokenizer, self.eos_token_ids, self.max_model_len,
                                     self.model_config.vocab_size, self.kv, can_fork, self.config.seed)
        # beam search (lmplug.beam): beam groups select through their own stage, the rest as before
        # (a cache that forks by copying, "fork_copy", serves beams: a dropped beam frees the row its sibling takes)
        self._can_fork = can_fork or (self.parallel is None and "fork_copy" in self.kv.capabilities.features
                                      and not self.kv.spec.states)
        self.selector = SelectRouter(self.selector, BeamStage(
            self.kv, self.requests, self.eos_token_ids, self.max_model_len, self.tokenizer))
        self.observers = Observers(self.registry)
        self._observe_steps = self.observers.wanted("lmplug_step_finished")
        self.last_stats: dict = {}
        self.observers.notify("lmplug_engine_started", engine=self)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at interpreter exit), and let the
        KV cache finish what outlives it (a KV connector's pending writes)."""
        if self.parallel is not None:
            self.parallel.close()
        kv = getattr(self, "kv", None)  # None: the build failed before the cache existed
        if kv is not None:
            kv.close()

    # -- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None,
                    *, priority: int = 0) -> None:
        """Admit a request. Everything that can be wrong with it fails here, before any state: token
        ids past the vocabulary (``logit_bias``, ``stop_token_ids``), a constraint that does not
        compile (``ConstraintError`` naming the field), ``exact`` under a lossy acceptance rule."""
        params = params or SamplingParams()
        check_token_ids(params, self.model_config.vocab_size)
        if params.beam_width:
            check_beam_request(params, max_num_seqs=self.kv.spec.max_num_seqs, can_fork=self._can_fork,
                               speculative=self.speculator is not None)
        if self.speculator is not None:
            self.speculator.admit(params)
        self.constraints.admit(params)
        for seq in self.requests.add(request_id, prompt, params, priority):
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id)
        self.scheduler.abort(request_id)
        if req is not None:
            for seq in req.seqs:
                if not seq.is_finished:
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                self.selector.release(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return an output for every request that made progress.

        One request's failure stays its own: an exception while selecting, scoring or appending
        its tokens finishes that request with ``finish_reason="error"`` and the others go on
        (``_commit``). A forward pass that raises cannot be pinned to one request: it propagates.
        """
        started = time.perf_counter()
        plan = self._schedule()
        if not plan.scheduled:
            return []
        # decode tokens (drafts included): those of sequences already past their prompt
        num_decode = sum(s.num_new_tokens for s in plan.scheduled if not s.seq.is_prefill)
        with self.runner.threads_for([s.num_new_tokens for s in plan.scheduled],
                                     [s.seq.num_computed_tokens + s.num_new_tokens for s in plan.scheduled]):
            result = self.runner.execute(plan.scheduled)
            finished, failed = self._commit(plan.scheduled, result)
        self.scheduler.update(finished)
        self._end_failed(failed)
        outputs = self.requests.outputs([item.seq for item in plan.scheduled])
        if self.speculator is not None:  # which acceptance rule decided these tokens, and whether it is exact
            for out in outputs:
                if out.metrics is not None:
                    out.metrics.acceptance_rule, out.metrics.lossy = self.speculator.rule_name, self.speculator.lossy
        for out in outputs:
            if out.finished:
                self.observers.notify("lmplug_request_finished", engine=self, output=out)
        self._report(plan, started, num_decode)
        return outputs

    def _schedule(self) -> SchedulerOutput:
        """The select stage proposes (speculative drafts: each sequence's lookahead), the
        scheduler picks the step's work, the select stage fills in the rows it was given."""
        self.scheduler.set_lookahead(self.selector.propose(self.requests.sequences()))
        plan = self.scheduler.schedule()
        self.selector.plan(plan.scheduled)
        return plan

    def _commit(self, scheduled: list[ScheduledSeq], result) -> tuple[list[Sequence], list[Sequence]]:
        """Advance the computed counts, select the next tokens, append them; returns the
        scheduled sequences that finished (failed ones included) and those that failed."""
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        guard = StepFailures()
        for seq_id, (first, logits) in result.prompt_logits.items():
            seq = next(s.seq for s in scheduled if s.seq.seq_id == seq_id)
            guard.guarded(seq, "prompt logprobs", record_prompt_logprobs, seq, first, logits, self.tokenizer)
        if result.logits is None:
            return list(guard.failed), guard.failed
        seqs, logits, hidden, num_rows, forked = self.requests.fork_siblings(
            [item.seq for item in result.sample_rows], result.logits, result.hidden, result.num_rows)
        emitted, rows = guard.select(self.selector, logits, num_rows, seqs, hidden)
        ok = [i for i, s in enumerate(seqs) if s not in guard]
        logprobs = guard.logprobs(logits, [seqs[i] for i in ok], [emitted[i] for i in ok],
                                  [rows[i] for i in ok], self.tokenizer)
        now, finished = time.perf_counter(), list(guard.failed)
        for i, lps in zip(ok, logprobs):
            if seqs[i] not in guard and guard.guarded(
                    seqs[i], "output", self.requests.append, [seqs[i]], [emitted[i]], [lps], now):
                finished.append(seqs[i])
        finished += [s for s in guard.failed if s not in finished]
        for seq in guard.failed:
            if seq not in seqs:  # failed before sampling (prompt logprobs); settle releases the rest
                self.selector.release(seq)
        self.selector.settle(seqs)  # failed ones are finished: released, not observed
        # a select stage may end sequences itself (a beam group ends all its beams at once)
        finished += [s for s in seqs if s.is_finished and s not in finished]
        for seq in forked:
            if seq.is_finished:
                self.kv.free(seq)  # never reached the scheduler, so it cannot free it
            else:
                self.scheduler.add_running(seq)
        return [s for s in finished if s not in forked], guard.failed

    def _end_failed(self, failed: list[Sequence]) -> None:
        """A request with a failed sequence ends: its other sequences finish with "error" too."""
        for request_id in dict.fromkeys(s.request_id for s in failed):
            if request_id not in self.requests:
                continue
            req = self.requests[request_id]
            for seq in req.seqs:
                if not seq.is_finished:
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "error"
                    self.selector.release(seq)
            req.pending_forks = []
            self.scheduler.abort(request_id)

    def _report(self, plan: SchedulerOutput, started: float, decode: int) -> None:
        self.last_stats = {
            "num_running": self.scheduler.num_running, "num_waiting": self.scheduler.num_waiting,
            "num_prefill_tokens": plan.num_tokens - decode, "num_decode_tokens": decode,
            "kv_usage": self.kv.usage, "step_time_s": time.perf_counter() - started,
        }
        self.last_stats.update(self.selector.stats())
        if self._observe_steps:
            self.observers.notify("lmplug_step_finished", engine=self, stats=self.last_stats)
