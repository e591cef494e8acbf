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

from lmplug.config import ResolvedConfig
from lmplug.engine.build import EngineParts, build_engine_parts
from lmplug.engine.select import Sampler
from lmplug.interfaces.params import SamplingParams
from lmplug.interfaces.scheduler import ScheduledSeq, SchedulerOutput
from lmplug.interfaces.sequence import Sequence, SequenceStatus
from lmplug.outputs import RequestOutput, RequestTable
from lmplug.outputs.logprobs import record_prompt_logprobs, token_logprobs
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
        self.speculator = None if parts.drafter is None else Speculator(
            parts.drafter, parts.drafter.options.num_tokens, self.kv, self.max_model_len)
        self.selector = self.speculator or Sampler()
        # n > 1 shares the prompt's KV when the cache and the scheduler both declare "fork"
        # (not under tensor parallelism: a fork's copy-on-write block copies happen in rank 0's pool only)
        can_fork = (self.parallel is None and "fork" in self.kv.capabilities.features
                    and "fork" in self.scheduler.capabilities.features)
        self.requests = RequestTable(self.tokenizer, self.eos_token_ids, self.max_model_len,
                                     self.model_config.vocab_size, self.kv, can_fork, self.config.seed)
        self._observe_steps = bool(self.registry.hook.lmplug_step_finished.get_hookimpls())
        self.last_stats: dict = {}
        self.registry.hook.lmplug_engine_started(engine=self)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at interpreter exit)."""
        if self.parallel is not None:
            self.parallel.close()

    # -- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None,
                    *, priority: int = 0) -> None:
        for seq in self.requests.add(request_id, prompt, params or SamplingParams(), priority):
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
        """Run one step; return an output for every request that made progress."""
        started = time.perf_counter()
        plan = self._schedule()
        if not plan.scheduled:
            return []
        # decode tokens (drafts included): those of sequences already past their prompt
        num_decode = sum(s.num_new_tokens for s in plan.scheduled if not s.seq.is_prefill)
        result = self.runner.execute(plan.scheduled)
        finished = self._commit(plan.scheduled, result)
        self.scheduler.update(finished)
        outputs = self.requests.outputs([item.seq for item in plan.scheduled])
        for out in outputs:
            if out.finished:
                self.registry.hook.lmplug_request_finished(engine=self, output=out)
        self._report(plan, started, num_decode)
        return outputs

    def _schedule(self) -> SchedulerOutput:
        """The select stage proposes (speculative drafts: each sequence's lookahead), the
        scheduler picks the step's work, the select stage fills in the rows it was given."""
        self.scheduler.set_lookahead(self.selector.propose(self.requests.sequences()))
        plan = self.scheduler.schedule()
        self.selector.plan(plan.scheduled)
        return plan

    def _commit(self, scheduled: list[ScheduledSeq], result) -> list[Sequence]:
        """Advance the computed counts, select the next tokens, append them; returns the
        scheduled sequences that finished."""
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        for seq_id, (first, logits) in result.prompt_logits.items():
            seq = next(s.seq for s in scheduled if s.seq.seq_id == seq_id)
            record_prompt_logprobs(seq, first, logits)
        if result.logits is None:
            return []
        seqs, logits, hidden, num_rows, forked = self.requests.fork_siblings(
            [item.seq for item in result.sample_rows], result.logits, result.hidden, result.num_rows)
        emitted, rows = self.selector.select(logits, num_rows, seqs, hidden)
        logprobs = token_logprobs(logits, seqs, emitted, rows)
        finished = self.requests.append(seqs, emitted, logprobs, time.perf_counter())
        self.selector.settle(seqs)
        for seq in forked:
            if seq.is_finished:
                self.kv.free(seq)  # never reached the scheduler, so it cannot free it
            else:
                self.scheduler.add_running(seq)
        return [s for s in finished if s not in forked]

    def _report(self, plan: SchedulerOutput, started: float, decode: int) -> None:
        self.last_stats = {
            "num_running": self.scheduler.num_running, "num_waiting": self.scheduler.num_waiting,
            "num_prefill_tokens": plan.num_tokens - decode, "num_decode_tokens": decode,
            "kv_usage": self.kv.usage, "step_time_s": time.perf_counter() - started,
        }
        self.last_stats.update(self.selector.stats())
        if self._observe_steps:
            self.registry.hook.lmplug_step_finished(engine=self, stats=self.last_stats)
