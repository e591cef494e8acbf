"""``LLMEngine``: the loop. Each step: schedule -> run -> select -> commit.

The stages live elsewhere: the scheduler plugin picks the work, ``ModelRunner`` runs the
forward, the select stages (``stages.SelectStages``: beam groups, the sampler or the speculator,
one ``lmplug.interfaces.select.SelectStage`` to the engine) pick the tokens, and ``lmplug.outputs`` appends them, checks stops and builds
what callers receive.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq

from lmplug.config import ResolvedConfig
from lmplug.constraints import Constraints
from lmplug.engine.adapters import cache_salt
from lmplug.engine.build import EngineParts, build_engine_parts
from lmplug.engine.forks import Forks
from lmplug.engine.isolation import Observers, StepFailures
from lmplug.engine.stages import build_select_stages
from lmplug.engine.virtual import VirtualSchedulers
from lmplug.errors import ConfigError
from lmplug.interfaces.adapter import LoRARequest
from lmplug.interfaces.engine_view import EngineView
from lmplug.interfaces.params import SamplingParams, check_token_ids
from lmplug.interfaces.scheduler import ScheduledSeq, SchedulerOutput
from lmplug.interfaces.sequence import Sequence
from lmplug.loading.pooling_config import ModelPooling
from lmplug.outputs import RequestOutput, RequestTable
from lmplug.outputs.logprobs import record_prompt_logprobs
from lmplug.outputs.pooling import Pooler, PoolingParams
from lmplug.plugins import Registry, get_registry
from lmplug.speculative import Speculator

logger = logging.getLogger(__name__)


def check_pooling(engine: LLMEngine, pooling: PoolingParams) -> PoolingParams:
    """An embedding request's pooling, or why this model cannot pool so. Each field: the request's,
    else the ``pooler`` section's, else the checkpoint's sentence-transformers recipe, else last
    token and normalized."""
    model, name = engine.runner.model, engine.config.model
    if not getattr(model, "final_hidden_states", False):
        raise ConfigError(
            f"model {name!r} ({type(model).__name__}) cannot pool: its forward does not declare "
            "that it returns the final-norm hidden states (final_hidden_states); embeddings work with the native "
            "architectures (lmplug plugins --family model) and the transformers fallback")
    recipe, section = engine.parts.pooling, engine.config.pooler
    kind = pooling.pooling_type or (None if section.pooling_type == "auto" else section.pooling_type)
    if kind is None and recipe.unsupported:
        raise ConfigError(f"model {name!r} cannot pool as its sentence-transformers config asks: "
                          f"{recipe.unsupported}; pool it another way with the pooler section's pooling_type "
                          "(last, mean or cls)")
    if pooling.dimensions is not None:
        _check_dimensions(name, pooling.dimensions, recipe, engine.model_config.hidden_size)
    normalize = next(v for v in (section.normalize, recipe.normalize, True) if v is not None)
    return pooling.with_defaults(kind or recipe.pooling_type or "last", normalize)


def _check_dimensions(name: str, dimensions: int, recipe: ModelPooling, hidden: int) -> None:
    if not recipe.matryoshka:
        raise ConfigError(f"dimensions: {name!r} declares no Matryoshka dimensions (config.json "
                          f"matryoshka_dimensions or is_matryoshka), so its embeddings cannot be truncated; "
                          f"leave dimensions out (full size {hidden})")
    if recipe.matryoshka_dimensions and dimensions not in recipe.matryoshka_dimensions:
        raise ConfigError(f"dimensions: {dimensions} is not one of the sizes {name!r} was trained for "
                          f"({', '.join(map(str, recipe.matryoshka_dimensions))})")
    if dimensions > hidden:
        raise ConfigError(f"dimensions: {dimensions} is more than {name!r}'s embedding size {hidden}")


class LLMEngine:
    def __init__(self, resolved: ResolvedConfig, registry: Registry | None = None) -> None:
        self.registry = registry or get_registry()
        self.resolved = resolved
        self.config = resolved.config
        self.registry.hook.lmplug_configure(config=self.config)
        # tensor / pipeline parallelism: rank 0 (this process) starts the workers, then every rank
        # builds its shard or stage
        self.parallel = None
        if self.config.parallel.tensor_parallel_size > 1 or self.config.parallel.pipeline_parallel_size > 1:
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
        # pipeline parallel: up to P micro-batches in flight, one per scheduler (``virtual.py``);
        # the plain sampler only (drafts are planned into a step before it runs)
        self.virtual: VirtualSchedulers | None = None
        self._in_flight: dict[int, tuple] = {}
        stages = self.config.parallel.pipeline_parallel_size
        if stages > 1 and parts.drafter is None and not parts.plan.encoder:
            self.virtual = self.scheduler = VirtualSchedulers(parts.scheduler, stages)
        self.runner = parts.runner
        self.adapters = parts.adapters  # LoRA adapters (``lora:`` section), None: none
        self.max_model_len = parts.max_model_len
        self.eos_token_ids = parts.eos_token_ids
        self.constraints = Constraints(parts.constraint, self.model_config.vocab_size)
        self.requests = RequestTable(self.tokenizer, self.eos_token_ids, self.max_model_len,
                                     self.model_config.vocab_size, self.config.seed,
                                     whole_prompts=parts.plan.encoder)
        self.forks = Forks(self.kv, self.scheduler, parallel=self.parallel is not None)  # n > 1
        # the select stages (beam groups; the speculator or the sampler), behind one SelectStage
        # beams fork through the cache's fork, or its "fork_copy" (a dropped beam frees the row its
        # sibling takes); under tensor parallelism every rank repeats the copies ("tp_copies")
        features = self.kv.capabilities.features
        beams_fork = (("fork" in features and "fork" in self.scheduler.capabilities.features
                       or "fork_copy" in features) and not self.kv.spec.states
                      and (self.parallel is None or "tp_copies" in features))
        self.selector = build_select_stages(parts, self.constraints, self.requests, can_fork=beams_fork)
        self.pooler = Pooler()  # embedding requests' partial pools (``lmplug.outputs.pooling``)
        self.observers = Observers(self.registry)
        self._observe_steps = self.observers.wanted("lmplug_step_finished")
        self.last_stats: dict = {}
        # what the lifecycle hooks hand observers: read-only facts, not the engine
        self.view = EngineView(self.config, {f: b.name for f, b in self.resolved.backends.items()},
                               self.model_config, self.max_model_len, lambda: self.last_stats)
        self.observers.notify("lmplug_engine_started", engine=self.view)

    @property
    def speculator(self) -> Speculator | None:
        """The speculative select stage, when a drafter is configured (its counts, for reports)."""
        return self.selector.find(Speculator)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at interpreter exit), and let the
        KV cache finish what outlives it (a KV connector's pending writes)."""
        if self.parallel is not None:
            self.parallel.close()
        constraints = getattr(self, "constraints", None)
        if constraints is not None:
            constraints.close()
        kv = getattr(self, "kv", None)  # None: the build failed before the cache existed
        if kv is not None:
            kv.close()

    # -- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None,
                    *, priority: int = 0, pooling: PoolingParams | None = None,
                    lora: LoRARequest | None = None) -> None:
        """Admit a request. Everything that can be wrong with it fails here, before any state: token
        ids past the vocabulary (``logit_bias``, ``stop_token_ids``), a constraint that does not
        compile (``ConstraintError`` naming the field), ``exact`` under a lossy acceptance rule.
        ``pooling``: an embedding request (prefill only; ``params`` unused), refused by a model
        that cannot pool. ``lora``: the adapter it runs with (read and checked on first use;
        ``UnknownAdapter`` for a name that was never loaded and comes without its folder)."""
        salt = self._adapter_of(lora)
        if pooling is not None:
            pooling = check_pooling(self, pooling)
            for seq in self.requests.add(request_id, prompt, SamplingParams(max_tokens=1), priority, pooling):
                if lora is not None:
                    seq.adapter, seq.cache_salt = lora.lora_name, salt
                self.scheduler.add(seq)
            return
        if self.parts.plan.encoder:
            raise ConfigError(f"model {self.config.model!r} is an encoder ({self.model_config.model_type}, "
                              "bidirectional attention): it serves embeddings (LLM.embed, /v1/embeddings), "
                              "not generation")
        if self.parts.pooling.headless:
            raise ConfigError(f"model {self.config.model!r} was saved without its LM head (config.json "
                              "architectures: a base model, as embedding checkpoints are): it serves embeddings "
                              "(LLM.embed, /v1/embeddings), not generation")
        params = params or SamplingParams()
        if self.virtual is not None and params.beam_width:
            raise ConfigError("beam_width: beam search is not supported with pipeline parallelism "
                              "(parallel.pipeline_parallel_size > 1) yet")
        check_token_ids(params, self.model_config.vocab_size)
        self.selector.admit(params)
        self.constraints.admit(params, request_id)
        for seq in self.forks.hold(request_id, self.requests.add(request_id, prompt, params, priority)):
            if lora is not None:
                seq.adapter, seq.cache_salt = lora.lora_name, salt
            self.scheduler.add(seq)

    # -- LoRA adapters (vLLM's names) ---------------------------------------------------------
    def add_lora(self, lora: LoRARequest) -> None:
        """Read and check an adapter now (``ModelLoadError`` naming it and the field)."""
        self._adapter_of(lora)

    def remove_lora(self, name: str) -> None:
        """Forget adapter ``name`` (``UnknownAdapter``); refused while requests run with it."""
        if self.adapters is None:
            raise ConfigError("this engine serves no LoRA adapters (no `lora:` section)")
        busy = sum(1 for seq in self.requests.sequences() if seq.adapter == name and not seq.is_finished)
        if busy:
            raise ConfigError(f"LoRA adapter {name!r} is in use by {busy} running sequence(s); unload it "
                              "once they finish")
        self.adapters.remove(name)

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.adapters is None else list(self.adapters.known.values())

    def _adapter_of(self, lora: LoRARequest | None) -> int | None:
        """The prefix-cache salt of ``lora``'s adapter, known to the engine from now on."""
        if lora is None:
            return None
        if self.adapters is None:
            raise ConfigError(f"LoRA adapter {lora.lora_name!r}: this engine serves no adapters; add a "
                              "`lora:` section to its config (e.g. lora: {max_loras: 4, max_lora_rank: 16})")
        self.adapters.add(lora)
        return cache_salt(lora)

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id)
        self.forks.drop(request_id)
        self.scheduler.abort(request_id)
        if req is not None:
            for seq in req.seqs:
                if not seq.is_finished:
                    seq.finish("abort")
                self.selector.release(seq)
                self.pooler.release(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return an output for every request that made progress.

        One request's failure stays its own: an exception while selecting, scoring or appending
        its tokens finishes that request with ``finish_reason="error"`` and the others go on
        (``_commit``). A forward pass that raises cannot be pinned to one request: it propagates.
        """
        if self.virtual is not None:
            return self._micro_batch_step()
        started = time.perf_counter()
        plan = self._schedule()
        if not plan.scheduled:
            return []
        num_decode = _decode_tokens(plan)
        with self.runner.threads_for([s.num_new_tokens for s in plan.scheduled],
                                     [s.seq.num_computed_tokens + s.num_new_tokens for s in plan.scheduled]):
            result = self.runner.execute(plan.scheduled)
            finished, failed = self._commit(plan.scheduled, result)
        return self._settle_step(self.scheduler, plan, started, num_decode, finished, failed)

    @property
    def batches_in_flight(self) -> int:
        """Pipeline parallel: micro-batches submitted and not yet collected (at most P)."""
        return len(self._in_flight)

    def _micro_batch_step(self) -> list[RequestOutput]:
        """Pipeline parallel: collect this turn's batch in flight (its outputs are the step's), then
        schedule and submit the turn's next batch without waiting for it."""
        turn = self.virtual.turn()
        outputs = self._collect(*self._in_flight.pop(turn)) if turn in self._in_flight else []
        scheduler = self.virtual.members[turn]
        plan = scheduler.schedule()
        if plan.scheduled:
            self._in_flight[turn] = (scheduler, plan, time.perf_counter(), _decode_tokens(plan),
                                     self.runner.submit(plan.scheduled))
        return outputs

    def _collect(self, scheduler, plan: SchedulerOutput, started: float, num_decode: int,
                 finish) -> list[RequestOutput]:
        self.selector.plan(plan.scheduled)  # the sampler's structured-output masks (no drafts here)
        finished, failed = self._commit(plan.scheduled, finish())
        return self._settle_step(scheduler, plan, started, num_decode, finished, failed)

    def _settle_step(self, scheduler, plan: SchedulerOutput, started: float, num_decode: int,
                     finished: list[Sequence], failed: list[Sequence]) -> list[RequestOutput]:
        """The scheduler told what finished; the step's outputs, observers and statistics."""
        scheduler.update(finished)
        self._end_failed(failed)
        outputs = self.requests.outputs([item.seq for item in plan.scheduled])
        self.selector.annotate(outputs)
        for out in outputs:
            if out.finished:
                self.observers.notify("lmplug_request_finished", engine=self.view, output=out)
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
            item.seq.advance(item.num_new_tokens)
        pooled = self._pool(scheduled, result.pooled)
        guard = StepFailures()
        for seq_id, (first, logits) in result.prompt_logits.items():
            seq = next(s.seq for s in scheduled if s.seq.seq_id == seq_id)
            guard.guarded(seq, "prompt logprobs", record_prompt_logprobs, seq, first, logits, self.tokenizer)
        if result.logits is None:
            return list(guard.failed) + pooled, guard.failed
        seqs, logits, hidden, num_rows, forked = self.forks.fork(
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
        # a select stage may end sequences itself: a beam group ends all its beams at once, those
        # that did not run this step (they waited for a sibling's prefill chunk) too
        finished += [s for s in seqs if s.is_finished and s not in finished]
        finished += [s for s in self._ended_beams(seqs) if s not in finished]
        self.forks.place(forked)
        return [s for s in finished if s not in forked] + pooled, guard.failed

    def _ended_beams(self, seqs: list[Sequence]) -> list[Sequence]:
        """The finished beams of the beam groups among ``seqs`` (the scheduler frees them)."""
        reqs = [self.requests[rid] for rid in dict.fromkeys(s.request_id for s in seqs) if rid in self.requests]
        return [s for req in reqs if req.beam_results is not None for s in req.seqs if s.is_finished]

    def _pool(self, scheduled: list[ScheduledSeq], pooled: dict) -> list[Sequence]:
        """Embedding sequences: pool this step's hidden states; those whose prompt is done end."""
        if not pooled:
            return []
        now, done = time.perf_counter(), self.pooler.take(pooled, [item.seq for item in scheduled])
        for seq, vector in done:
            self.requests.finish_pooled(seq, vector, now)
        return [seq for seq, _ in done]

    def _end_failed(self, failed: list[Sequence]) -> None:
        """A request with a failed sequence ends: its other sequences finish with "error" too."""
        for request_id in dict.fromkeys(s.request_id for s in failed):
            if request_id not in self.requests:
                continue
            req = self.requests[request_id]
            for seq in req.seqs:
                if not seq.is_finished:
                    seq.finish("error")
                    self.selector.release(seq)
            self.forks.drop(request_id)
            self.scheduler.abort(request_id)

    def _report(self, plan: SchedulerOutput, started: float, decode: int) -> None:
        self.last_stats = {
            "num_running": self.scheduler.num_running, "num_waiting": self.scheduler.num_waiting,
            "num_prefill_tokens": plan.num_tokens - decode, "num_decode_tokens": decode,
            "kv_usage": self.kv.usage, "step_time_s": time.perf_counter() - started,
        }
        self.last_stats.update(self.selector.stats())
        if self._observe_steps:
            self.observers.notify("lmplug_step_finished", engine=self.view, stats=self.last_stats)


def _decode_tokens(plan: SchedulerOutput) -> int:
    """Decode tokens (drafts included): those of sequences already past their prompt."""
    return sum(s.num_new_tokens for s in plan.scheduled if not s.seq.is_prefill)
