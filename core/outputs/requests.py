"""The request table: each request's sequences, its text state and its outputs (``n > 1`` forks
are ``lmplug.engine.forks``')."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

import torch

from lmplug.errors import ConfigError
from lmplug.interfaces.params import SamplingParams
from lmplug.interfaces.sequence import Sequence
from lmplug.outputs.pooling import EmbeddingOutput, EmbeddingRequestOutput, PoolingParams, truncate
from lmplug.outputs.stopping import check_stop
from lmplug.outputs.types import CompletionOutput, RequestMetrics, RequestOutput


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], seqs: list[Sequence],
                 detokenizers: list) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.seqs = seqs
        self.detokenizers = detokenizers
        self.sent_tokens = [0] * len(seqs)  # streaming: tokens already reported per sequence
        self.sent_text = [0] * len(seqs)
        # beam search: the returned hypotheses (``lmplug.beam.search.Hypothesis``), set when the group ends
        self.beam_results: list | None = None
        self.beam_finish: list[tuple[str, str | int | None]] = []  # (finish_reason, stop_reason) each
        self.embedding: list[float] | None = None  # an embedding request's vector, once pooled
        self.pooling: PoolingParams | None = None  # an embedding request's pooling (defaults filled in)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def output(self) -> RequestOutput:
        """The request so far; the deltas are what changed since the previous call."""
        if self.beam_results is not None:
            return self._beam_output()
        if getattr(self, "params", None) is not None and self.params.beam_width:
            return self._beam_pending_output()
        if self.seqs[0].pooling is not None:
            return self._embedding_output()
        if getattr(self, "params", None) is not None and (self.params.best_of or 0) > self.params.n:
            return self._best_of_output()
        completions, delta_text, delta_ids = [], "", []
        for i, seq in enumerate(self.seqs):
            text = seq.text
            if not seq.is_finished and seq.params.stop:
                # hold back what may be the start of a stop string: once it completes, the text
                # is cut before it, and a streamed delta cannot be taken back
                hold = max(len(s) for s in seq.params.stop) - 1
                text = text[:max(len(text) - hold, self.sent_text[i])]
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=seq.output_token_ids,
                logprobs=seq.logprobs if seq.params.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
            if i == 0:
                delta_ids = seq.output_token_ids[self.sent_tokens[0]:]
                delta_text = text[self.sent_text[0]:]
            self.sent_tokens[i], self.sent_text[i] = seq.num_output_tokens, len(text)
        first = self.seqs[0]
        metrics = RequestMetrics(first.arrival_time, first.first_token_time, first.finish_time,
                                 sum(s.num_drafted for s in self.seqs), sum(s.num_accepted for s in self.seqs),
                                 max(s.num_target_forwards for s in self.seqs))
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_ids,
            outputs=completions, finished=self.finished,
            prompt_logprobs=first.prompt_logprobs if first.params.prompt_logprobs is not None else None,
            metrics=metrics, delta_text=delta_text, delta_token_ids=delta_ids)


    def _embedding_output(self) -> EmbeddingRequestOutput:
        first = self.seqs[0]
        return EmbeddingRequestOutput(self.request_id, self.prompt, self.prompt_ids,
                                      EmbeddingOutput(self.embedding or []), self.finished,
                                      RequestMetrics(first.arrival_time, first.finish_time, first.finish_time))

    def _beam_output(self) -> RequestOutput:
        """A finished beam group: one completion per returned hypothesis, best first."""
        completions = [CompletionOutput(index=i, text=hyp.text, token_ids=hyp.token_ids, logprobs=None,
                                        finish_reason=reason, stop_reason=stop,
                                        cumulative_logprob=hyp.cum_logprob, score=hyp.score)
                       for i, (hyp, (reason, stop)) in enumerate(zip(self.beam_results, self.beam_finish))]
        first = self.seqs[0]
        metrics = RequestMetrics(first.arrival_time, first.first_token_time, first.finish_time,
                                 num_target_forwards=first.num_target_forwards)
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_ids,
                             outputs=completions, finished=True, metrics=metrics,
                             delta_text=completions[0].text, delta_token_ids=completions[0].token_ids)


    def _beam_pending_output(self) -> RequestOutput:
        """A beam group still running: nothing yet (its slots are beams, not its results; the
        results come when it ends). One that ended without results (an error, an abort): ``n``
        empty completions with the slots' finish reason."""
        seqs = self.seqs[:self.params.n] if self.finished else []
        completions = [CompletionOutput(index=i, text="", token_ids=[], logprobs=None,
                                        finish_reason=s.finish_reason, stop_reason=s.stop_reason)
                       for i, s in enumerate(seqs)]
        first = self.seqs[0]
        metrics = RequestMetrics(first.arrival_time, first.first_token_time, first.finish_time,
                                 num_target_forwards=first.num_target_forwards)
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_ids,
                             outputs=completions, finished=self.finished, metrics=metrics)

    def _best_of_output(self) -> RequestOutput:
        """``best_of`` samples: nothing until all are done, then the ``n`` with the highest cumulative
        logprob (of the raw model distribution), best first."""
        params = self.params
        cums = [_cumulative_logprob(s) for s in self.seqs]
        best = sorted(range(len(self.seqs)), key=lambda i: -cums[i])[:params.n] if self.finished else []
        completions = [CompletionOutput(index=k, text=self.seqs[i].text, token_ids=self.seqs[i].output_token_ids,
                                        logprobs=self.seqs[i].logprobs if params.logprobs is not None else None,
                                        finish_reason=self.seqs[i].finish_reason,
                                        stop_reason=self.seqs[i].stop_reason, cumulative_logprob=cums[i])
                       for k, i in enumerate(best)]
        first = self.seqs[0]
        metrics = RequestMetrics(first.arrival_time, first.first_token_time, first.finish_time,
                                 num_target_forwards=max(s.num_target_forwards for s in self.seqs))
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_ids,
                             outputs=completions, finished=self.finished, metrics=metrics,
                             delta_text=completions[0].text if completions else "",
                             delta_token_ids=completions[0].token_ids if completions else [])


def _cumulative_logprob(seq: Sequence) -> float:
    """The summed logprob of ``seq``'s output tokens (recorded because ``best_of_slot_params`` asks)."""
    return sum(row[token].logprob for row, token in zip(seq.logprobs, seq.output_token_ids))


def best_of_slot_params(params: SamplingParams) -> SamplingParams:
    """A best-of sample records at least its chosen token's logprob: the ranking needs it."""
    return dataclasses.replace(params, n=params.best_of, logprobs=params.logprobs or 0)


def beam_slot_params(params: SamplingParams) -> SamplingParams:
    """A beam slot's own params: it never stops by itself (the group decides, ``lmplug.beam``)."""
    return dataclasses.replace(params, n=1, stop=[], stop_token_ids=[], ignore_eos=True, max_tokens=None,
                               min_tokens=0)


class RequestTable:
    """The engine's live requests."""

    def __init__(self, tokenizer, eos_token_ids: frozenset[int], max_model_len: int, vocab_size: int,
                 seed: int, *, whole_prompts: bool = False) -> None:
        """``whole_prompts``: embedding prompts run whole (``Sequence.whole_prompt``: an encoder's)."""
        self.tokenizer = tokenizer
        self.whole_prompts = whole_prompts
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self._requests: dict[str, Request] = {}
        self._seed_rng = torch.Generator().manual_seed(seed)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __getitem__(self, request_id: str) -> Request:
        return self._requests[request_id]

    def __len__(self) -> int:
        return len(self._requests)

    def pop(self, request_id: str) -> Request | None:
        return self._requests.pop(request_id, None)

    def sequences(self) -> list[Sequence]:
        """Every sequence of every live request, in arrival order."""
        return [s for req in self._requests.values() for s in req.seqs]

    # -- new requests ----------------------------------------------------------------------------
    def add(self, request_id: str, prompt: str | Seq[int], params: SamplingParams,
            priority: int = 0, pooling: PoolingParams | None = None) -> list[Sequence]:
        """Register a request; returns its sequences (``n``, or ``beam_width`` beam slots).
        ``pooling`` (defaults filled in): an embedding request, one prefill-only sequence."""
        if request_id in self._requests:
            raise ConfigError(f"request id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        self._check_prompt(request_id, ids, room=0 if pooling else 1)
        if pooling is not None:
            seq = Sequence(request_id, ids, params, priority=priority)
            seq.pooling, seq.pooling_normalize = pooling.pooling_type, bool(pooling.normalize)
            seq.whole_prompt = self.whole_prompts
            self._requests[request_id] = Request(request_id, text, ids, [seq], [None])
            self._requests[request_id].pooling = pooling
            return [seq]
        seqs, detoks = [], []
        best_of = params.best_of if (params.best_of or 0) > params.n else None
        slot_params = beam_slot_params(params) if params.beam_width else (
            best_of_slot_params(params) if best_of else params)
        for i in range(params.beam_width or best_of or params.n):
            gen = torch.Generator()
            seed = (params.seed + i) % 2**64 if params.seed is not None else int(
                torch.randint(0, 2**62, (1,), generator=self._seed_rng))
            gen.manual_seed(seed)
            seqs.append(Sequence(request_id, ids, slot_params, index=i, priority=priority, generator=gen))
            # a beam's text is decoded once, at the end, for the hypotheses returned
            detoks.append(None if params.beam_width else self._detokenizer(ids, params))
        req = Request(request_id, text, ids, seqs, detoks)
        req.params = params  # a beam group's own (its slots carry beam_slot_params)
        self._requests[request_id] = req
        return seqs

    def _check_prompt(self, request_id: str, ids: list[int], room: int = 1) -> None:
        """``room``: new tokens the prompt needs space for (a generation 1; an embedding none)."""
        if not ids:
            raise ConfigError(f"request {request_id!r}: the prompt is empty")
        if len(ids) + room > self.max_model_len:
            need = " (it needs room for at least one new token)" if room else ""
            raise ConfigError(f"request {request_id!r}: prompt of {len(ids)} tokens does not fit "
                              f"max_model_len={self.max_model_len}{need}")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ConfigError(f"request {request_id!r}: prompt token ids must be in [0, {self.vocab_size})")

    def _tokenize(self, prompt: str | Seq[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("this model has no tokenizer; pass prompt token ids instead of text")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ConfigError(f"prompt: not valid Unicode (a lone surrogate {prompt[exc.start]!r} at "
                                  f"character {exc.start})") from None
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams):
        if self.tokenizer is None:
            return None
        from lmplug.loading.tokenizer import IncrementalDetokenizer
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens)

    # -- tokens in, outputs out ------------------------------------------------------------------
    def finish_pooled(self, seq: Sequence, embedding: list[float], now: float) -> None:
        """An embedding sequence's prompt is pooled: it ends with its vector (no token sampled)."""
        req = self._requests[seq.request_id]
        req.embedding = truncate(embedding, req.pooling)
        seq.finish("stop", at=now)

    def append(self, seqs: list[Sequence], emitted: list[list[int]], logprobs: list[list[dict] | None],
               now: float) -> list[Sequence]:
        """Append each sequence's emitted tokens; returns the sequences that finished."""
        finished = []
        for seq, tokens, lps in zip(seqs, emitted, logprobs):
            seq.num_target_forwards += 1
            if self._append_tokens(seq, tokens, lps, now):
                finished.append(seq)
        return finished

    def _append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list[dict] | None,
                       now: float) -> bool:
        """Append ``tokens`` in order; the first that ends ``seq`` drops the rest. True if it ended."""
        if seq.first_token_time is None:
            seq.first_token_time = now
        detok = self._requests[seq.request_id].detokenizers[seq.index]
        for j, token in enumerate(tokens):
            new_text_from = len(seq.text)
            seq.append_token(token)
            if logprobs is not None:
                seq.logprobs.append(logprobs[j])
            if detok is not None and not self._is_stop_token(seq, token):
                detok.add([token])  # a stop token ends the text; it is not part of it
                seq.text = detok.text
            if check_stop(seq, token, self.eos_token_ids, self.max_model_len, new_text_from):
                if detok is not None and not isinstance(seq.stop_reason, str):
                    detok.flush()  # a character cut short by the end still shows
                    seq.text = detok.text
                seq.finish(at=now)
                return True
        return False

    def _is_stop_token(self, seq: Sequence, token: int) -> bool:
        params = seq.params
        if params.include_stop_str_in_output:
            return False
        return token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)

    def outputs(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """One output per live request among ``seqs`` (in order); finished requests leave."""
        seen, outputs = set(), []
        for seq in seqs:
            rid = seq.request_id
            if rid in seen or rid not in self._requests:
                continue
            seen.add(rid)
            if seq.pooling is not None and not seq.is_finished:
                continue  # an embedding has no partial output
            out = self._requests[rid].output()
            if out.finished:
                del self._requests[rid]
            outputs.append(out)
        return outputs
