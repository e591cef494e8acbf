"""``LLMEngine``: schedule -> execute -> sample -> update, one step at a time."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq

import torch

from lmplug.config import ResolvedConfig
from lmplug.engine.build import EngineParts, build_engine_parts
from lmplug.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from lmplug.engine.params import SamplingParams
from lmplug.engine.sampler import sample, top_logprobs
from lmplug.engine.sequence import Sequence, SequenceStatus
from lmplug.engine.speculative import Speculator
from lmplug.engine.stopping import check_stop
from lmplug.errors import ConfigError
from lmplug.interfaces import Scheduler
from lmplug.plugins import Registry, get_registry

logger = logging.getLogger(__name__)


class _Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], seqs: list[Sequence],
                 detokenizers: list) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.seqs = seqs
        self.detokenizers = detokenizers
        self.sent_tokens = [0] * len(seqs)  # streaming: tokens already reported per sequence
        self.sent_text = [0] * len(seqs)
        self.pending_forks: list[Sequence] = []  # siblings forked from seqs[0] at its first token

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, resolved: ResolvedConfig, registry: Registry | None = None) -> None:
        self.registry = registry or get_registry()
        self.resolved = resolved
        self.config = resolved.config
        self.registry.hook.lmplug_configure(config=self.config)
        # tensor parallelism: rank 0 (this process) starts the workers, then every rank builds its shard
        self.parallel = None
        if self.config.parallel.tensor_parallel_size > 1:
            from lmplug.parallel.setup import start

            self.parallel = start(resolved)
        try:
            parts: EngineParts = build_engine_parts(
                resolved, parallel=None if self.parallel is None else self.parallel.state)
        except BaseException:
            self.close()
            raise
        self.parts = parts
        self.memory = parts.memory  # weight bytes and KV bytes/token per tensor-parallel rank
        self.model_config = parts.model_config
        self.tokenizer = parts.tokenizer
        self.kv = parts.kv
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.runner.parallel = self.parallel
        self.max_model_len = parts.max_model_len
        self.eos_token_ids = parts.eos_token_ids
        self.speculator = None if parts.drafter is None else Speculator(
            parts.drafter, parts.drafter.options.num_tokens, self.kv, self.max_model_len)
        self.runner.keep_hidden = parts.drafter is not None and parts.drafter.uses_hidden_states
        self._requests: dict[str, _Request] = {}
        self._seed_rng = torch.Generator().manual_seed(self.config.seed)
        self._observe_steps = bool(self.registry.hook.lmplug_step_finished.get_hookimpls())
        # n > 1 shares the prompt's KV when the cache can fork and the scheduler takes forks
        # (not under tensor parallelism: a fork's copy-on-write block copies happen in rank 0's pool only)
        self._can_fork = (self.parallel is None and "fork" in self.kv.capabilities.features
                          and type(self.scheduler).add_running is not Scheduler.add_running)
        self.last_stats: dict = {}
        self.registry.hook.lmplug_engine_started(engine=self)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at interpreter exit)."""
        if self.parallel is not None:
            self.parallel.close()

    # -- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None,
                    *, priority: int = 0) -> None:
        params = params or SamplingParams()
        if request_id in self._requests:
            raise ConfigError(f"request id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ConfigError(f"request {request_id!r}: the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ConfigError(f"request {request_id!r}: prompt of {len(ids)} tokens does not fit "
                              f"max_model_len={self.max_model_len} (it needs room for at least one new token)")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ConfigError(f"request {request_id!r}: prompt token ids must be in [0, {vocab})")
        seqs, detoks = [], []
        for i in range(params.n):
            gen = torch.Generator()
            seed = params.seed + i if params.seed is not None else int(
                torch.randint(0, 2**62, (1,), generator=self._seed_rng))
            gen.manual_seed(seed)
            seq = Sequence(request_id, ids, params, index=i, priority=priority, generator=gen)
            seqs.append(seq)
            detoks.append(self._detokenizer(ids, params))
        req = _Request(request_id, text, ids, seqs, detoks)
        self._requests[request_id] = req
        if self._can_fork:
            req.pending_forks = seqs[1:]
            seqs = seqs[:1]
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        self.scheduler.abort(request_id)
        if req is not None:
            for seq in req.seqs:
                if not seq.is_finished:
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                if self.speculator is not None:
                    self.speculator.release(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return an output for every request that made progress."""
        started = time.perf_counter()
        drafted = self._propose_drafts()
        plan = self.scheduler.schedule()
        if drafted:
            self.speculator.drop_unscheduled(plan.scheduled, drafted)
        if not plan.scheduled:
            return []
        # decode tokens (drafts included): those of sequences already past their prompt
        num_decode = sum(s.num_new_tokens for s in plan.scheduled if not s.seq.is_prefill)
        result = self.runner.execute(plan.scheduled)
        finished = self._postprocess(plan.scheduled, result)
        self.scheduler.update(finished)
        outputs = self._collect_outputs(plan.scheduled)
        self._report(plan, started, num_decode)
        return outputs

    def _propose_drafts(self) -> list[Sequence]:
        """Speculative decoding: drafts appended to every running decode sequence."""
        if self.speculator is None:
            return []
        decoding = [s for req in self._requests.values() for s in req.seqs
                    if s.status is SequenceStatus.RUNNING and not s.is_prefill
                    and s.num_computed_tokens == s.num_tokens - 1]
        self.speculator.propose(decoding)
        return decoding

    def _postprocess(self, scheduled, result) -> list[Sequence]:
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        for seq_id, (first, logits) in result.prompt_logits.items():
            seq = next(s.seq for s in scheduled if s.seq.seq_id == seq_id)
            self._record_prompt_logprobs(seq, first, logits)
        if result.logits is None:
            return []
        seqs = [item.seq for item in result.sample_rows]
        logits, hidden, num_rows = result.logits, result.hidden, result.num_rows
        forked, parent_rows = self._fork_siblings(seqs, num_rows)
        if forked:  # the children's rows are copies of their parents' last rows
            logits = torch.cat([logits, logits[parent_rows]])
            hidden = None if hidden is None else torch.cat([hidden, hidden[parent_rows]])
            num_rows = num_rows + [1] * len(forked)
        seqs = seqs + forked
        emitted, rows = self._next_tokens(logits, num_rows, seqs, hidden)
        logprobs = self._token_logprobs(logits, seqs, emitted, rows)
        now = time.perf_counter()
        finished = []
        for seq, tokens, lps in zip(seqs, emitted, logprobs):
            seq.num_target_forwards += 1
            if self._append_tokens(seq, tokens, lps, now):
                finished.append(seq)
            if self.speculator is not None:
                self.speculator.rollback(seq)
                if seq.is_finished:
                    self.speculator.release(seq)
        if self.speculator is not None:
            self.speculator.observe(seqs)
        for seq in forked:
            if seq.is_finished:
                self.kv.free(seq)  # never reached the scheduler, so it cannot free it
            else:
                self.scheduler.add_running(seq)
        return [s for s in finished if s not in forked]

    def _next_tokens(self, logits: torch.Tensor, num_rows: list[int], seqs: list[Sequence],
                     hidden: torch.Tensor | None) -> tuple[list[list[int]], list[list[int]]]:
        """Per sequence: the tokens to append and the logits row each came from.

        Without speculation one sampled token each; with it, the verified drafts plus one.
        """
        if self.speculator is not None:
            return self.speculator.verify(logits, num_rows, seqs, hidden)
        tokens = sample(logits, seqs)
        return [[t] for t in tokens], [[i] for i in range(len(tokens))]

    def _token_logprobs(self, logits: torch.Tensor, seqs: list[Sequence], emitted: list[list[int]],
                        rows: list[list[int]]) -> list[list[dict] | None]:
        want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        out: list[list[dict] | None] = [None] * len(seqs)
        if not want:
            return out
        k = max(seqs[i].params.logprobs for i in want)
        flat_rows = [r for i in want for r in rows[i]]
        chosen = torch.tensor([t for i in want for t in emitted[i]])
        entries = iter(top_logprobs(logits[flat_rows], chosen, k))
        for i in want:
            out[i] = [self._trim(next(entries), seqs[i].params.logprobs, t) for t in emitted[i]]
        return out

    def _append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list[dict] | None,
                       now: float) -> bool:
        """Append ``tokens`` in order; the first that ends ``seq`` drops the rest. True if it ended."""
        if seq.first_token_time is None:
            seq.first_token_time = now
        detok = self._requests[seq.request_id].detokenizers[seq.index]
        for j, token in enumerate(tokens):
            seq.token_ids.append(token)
            if logprobs is not None:
                seq.logprobs.append(logprobs[j])
            if detok is not None and not self._is_stop_token(seq, token):
                detok.add([token])  # a stop token ends the text; it is not part of it
                seq.text = detok.text
            if check_stop(seq, token, self.eos_token_ids, self.max_model_len):
                if detok is not None and not isinstance(seq.stop_reason, str):
                    detok.flush()  # a character cut short by the end still shows
                    seq.text = detok.text
                seq.status = SequenceStatus.FINISHED
                seq.finish_time = now
                return True
        return False

    def _fork_siblings(self, seqs: list[Sequence], num_rows: list[int]) -> tuple[list[Sequence], list[int]]:
        """Fork the waiting siblings of every sequence about to sample its first token.

        A child shares its parent's prompt KV (``kv.fork``) and samples its own
        first token, with its own generator, from the parent's (last) logits row.
        Returns the children and, for each, that row's index.
        """
        last_rows = torch.tensor(num_rows).cumsum(0).sub(1).tolist()
        rows, forked = [], []
        for i, parent in enumerate(seqs):
            req = self._requests[parent.request_id]
            if not req.pending_forks:
                continue
            for child in req.pending_forks:
                child.num_computed_tokens = parent.num_computed_tokens
                self.kv.fork(parent, child)
                rows.append(last_rows[i])
                forked.append(child)
            req.pending_forks = []
        return forked, rows

    def _is_stop_token(self, seq: Sequence, token: int) -> bool:
        params = seq.params
        if params.include_stop_str_in_output:
            return False
        return token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)

    def _record_prompt_logprobs(self, seq: Sequence, first: int, logits: torch.Tensor) -> None:
        """Logits at prompt position p predict token p + 1; entry 0 is None (nothing predicts it).

        Entries already recorded (before a preemption made the sequence recompute) are kept.
        """
        k = seq.params.prompt_logprobs
        if not seq.prompt_logprobs:
            seq.prompt_logprobs.append(None)
        start = max(first, len(seq.prompt_logprobs) - 1)
        upto = min(first + logits.shape[0], seq.num_prompt_tokens - 1)
        if upto <= start:
            return
        targets = torch.tensor(seq.token_ids[start + 1:upto + 1])
        rows = top_logprobs(logits[start - first:upto - first], targets, k)
        for row, tok in zip(rows, targets.tolist()):
            seq.prompt_logprobs.append(self._trim(row, k, tok))

    @staticmethod
    def _trim(row: dict, k: int, chosen: int) -> dict:
        kept = {tid: lp for tid, lp in row.items() if lp.rank <= k or tid == chosen}
        return kept

    def _collect_outputs(self, scheduled) -> list[RequestOutput]:
        seen, outputs = set(), []
        for item in scheduled:
            rid = item.seq.request_id
            if rid in seen or rid not in self._requests:
                continue
            seen.add(rid)
            req = self._requests[rid]
            out = self._make_output(req)
            if out.finished:
                del self._requests[rid]
                self.registry.hook.lmplug_request_finished(engine=self, output=out)
            outputs.append(out)
        return outputs

    def _make_output(self, req: _Request) -> RequestOutput:
        completions, delta_text, delta_ids = [], "", []
        for i, seq in enumerate(req.seqs):
            text = seq.text
            if not seq.is_finished and seq.params.stop:
                # hold back what may be the start of a stop string: once it completes, the text
                # is cut before it, and a streamed delta cannot be taken back
                hold = max(len(s) for s in seq.params.stop) - 1
                text = text[:max(len(text) - hold, req.sent_text[i])]
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=seq.output_token_ids,
                logprobs=seq.logprobs if seq.params.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
            if i == 0:
                delta_ids = seq.output_token_ids[req.sent_tokens[0]:]
                delta_text = text[req.sent_text[0]:]
            req.sent_tokens[i], req.sent_text[i] = seq.num_output_tokens, len(text)
        first = req.seqs[0]
        metrics = RequestMetrics(first.arrival_time, first.first_token_time, first.finish_time,
                                 sum(s.num_drafted for s in req.seqs), sum(s.num_accepted for s in req.seqs),
                                 max(s.num_target_forwards for s in req.seqs))
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_ids,
            outputs=completions, finished=req.finished,
            prompt_logprobs=first.prompt_logprobs if first.params.prompt_logprobs is not None else None,
            metrics=metrics, delta_text=delta_text, delta_token_ids=delta_ids)

    def _report(self, plan, started: float, decode: int) -> None:
        self.last_stats = {
            "num_running": self.scheduler.num_running, "num_waiting": self.scheduler.num_waiting,
            "num_prefill_tokens": plan.num_tokens - decode, "num_decode_tokens": decode,
            "kv_usage": self.kv.usage, "step_time_s": time.perf_counter() - started,
        }
        if self.speculator is not None:
            self.last_stats.update(self.speculator.stats())
        if self._observe_steps:
            self.registry.hook.lmplug_step_finished(engine=self, stats=self.last_stats)

    # -- text ------------------------------------------------------------------------------------
    def _tokenize(self, prompt: str | Seq[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("this model has no tokenizer; pass prompt token ids instead of text")
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams):
        if self.tokenizer is None:
            return None
        from lmplug.loading.tokenizer import IncrementalDetokenizer
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens)
