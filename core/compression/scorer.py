"""The scorer engine of prompt compression, and how a caller that left cancels it.

``EngineScorer`` runs a causal LM on its own ``LLMEngine`` (float32, CPU, a short context) and
scores texts with prompt logprobs, sliding a window over texts longer than its context; it is
built on first use and shared behind one lock. ``CANCEL`` lets a caller that gives up (the
server, when its client leaves) stop a compression within one engine step. Kept apart from
the segments and the settling because it alone runs a model.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from contextvars import ContextVar

from lmplug.config import EngineConfig, resolve
from lmplug.engine.engine import LLMEngine
from lmplug.errors import ConfigError, LmplugError
from lmplug.interfaces.compressor import Scorer
from lmplug.interfaces.params import SamplingParams

# Set by a caller that may give up (the server, when its client leaves): the scorer checks it
# between engine steps, so a compression nobody waits for stops within one step. A context
# variable, because the scorer is shared by requests and each runs in its own copied context.
CANCEL: ContextVar[threading.Event | None] = ContextVar("lmplug_compression_cancel", default=None)


class CompressionCancelled(LmplugError):
    """The caller set :data:`CANCEL`: nobody waits for this compression any more."""


def check_cancelled() -> None:
    cancel = CANCEL.get()
    if cancel is not None and cancel.is_set():
        raise CompressionCancelled("compression cancelled: its caller left")


class EngineScorer(Scorer):
    """A causal LM run by its own ``LLMEngine`` (float32, CPU), scoring with prompt logprobs."""

    def __init__(self, config: EngineConfig, max_len: int) -> None:
        self._config = config
        self._max_len = max_len
        self._engine: LLMEngine | None = None
        self._lock = threading.Lock()
        self._ids = itertools.count()

    def load(self) -> None:
        with self._lock:
            self._get()

    def _get(self) -> LLMEngine:
        if self._engine is None:
            try:
                resolved = resolve(self._config, device="cpu", dtype="float32", source="compression.scorer")
                engine = LLMEngine(resolved)
            except LmplugError as exc:
                raise ConfigError(f"compression.scorer: cannot load scorer model {self._config.model!r}: "
                                  f"{exc}") from None
            if engine.tokenizer is None:
                raise ConfigError(f"compression.scorer: model {self._config.model!r} has no tokenizer")
            self._engine = engine
        return self._engine

    def pieces(self, text: str) -> tuple[list[int], list[str]]:
        with self._lock:
            tok = self._get().tokenizer
        enc = tok.backend.encode(text, add_special_tokens=False)
        # token i owns text[end(i-1):end(i)]: whitespace a tokenizer trims from a token's offsets
        # stays with that token; the last one takes whatever follows
        ends, last = [], 0
        for _, end in enc.offsets:
            last = max(last, min(end, len(text)))
            ends.append(last)
        if ends:
            ends[-1] = len(text)
        return list(enc.ids), [text[a:b] for a, b in zip([0, *ends[:-1]], ends)]

    def decode(self, ids: Sequence[int]) -> str:
        with self._lock:
            return self._get().tokenizer.decode(list(ids))

    def token_logprobs(self, ids: Sequence[int]) -> list[float]:
        return self.token_logprobs_batch([ids])[0]

    def token_logprobs_batch(self, batch: Sequence[Sequence[int]]) -> list[list[float]]:
        with self._lock:
            engine = self._get()
            bos = engine.tokenizer.bos_token_id if engine.tokenizer.add_bos_token else None
            prefix = [] if bos is None else [bos]
            window = max(2, self._max_len - 1 - len(prefix))  # max_tokens=1 needs one slot
            stride = max(1, window // 2)
            out = [[0.0] * len(ids) for ids in batch]
            jobs: dict[str, tuple[int, int, int, list[int]]] = {}  # rid -> (item, start, skip, prompt)
            for item, ids in enumerate(batch):
                for context, start, end in _windows(len(ids), window, stride):
                    prompt = prefix + list(ids[context:end])
                    jobs[f"score-{next(self._ids)}"] = (item, start, len(prefix) + start - context, prompt)
            params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
            for rid, (_, _, _, prompt) in jobs.items():
                engine.add_request(rid, prompt, params)
            done = {}
            try:
                while engine.has_unfinished_requests():
                    check_cancelled()
                    for o in engine.step():
                        if o.finished:
                            done[o.request_id] = o
            except BaseException:
                for rid in jobs:
                    engine.abort_request(rid)
                raise
            for rid, (item, start, skip, prompt) in jobs.items():
                entries = done[rid].prompt_logprobs or []
                for p in range(skip, len(prompt)):
                    entry = entries[p] if p < len(entries) else None
                    out[item][start + p - skip] = entry[prompt[p]].logprob if entry else 0.0
            return out


def _windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """``(context, start, end)``: score tokens [start, end) given those from ``context``; texts
    longer than ``window`` go in steps of ``stride``, each with ``window - stride`` tokens before."""
    if n <= window:
        return [(0, 0, n)] if n else []
    return [(max(0, start - (window - stride)), start, min(n, start + stride)) for start in range(0, n, stride)]
