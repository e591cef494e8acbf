"""Prompt compression in the core: the scorer, the prompt's segments, the fallback, the report.

``PromptCompressor`` is built once per engine. For each request it settles the method and its
options (the request's ``CompressionParams`` over the config's ``compression:`` section), splits
the prompt into ``Segment`` s, runs the method and reports what happened (``CompressionReport``).

What is protected (never handed to a method as compressible): the final question (a text
prompt's last paragraph; in a chat, the last paragraph of the last user message), every system or
developer message, chat-role markup (only message contents are compressed; the template is applied
afterwards), and every occurrence of each ``protect`` string (one that does not occur is a
``ConfigError`` naming ``compression.protect``).

A method that raises, or returns protected segments changed, falls back to the full prompt with a
logged warning and ``CompressionReport.fallback`` set: a request is never lost to compression. A
scorer model that cannot load is a ``ConfigError`` naming ``compression.scorer`` instead.

The scorer (``EngineScorer``) is a separate ``LLMEngine`` (float32, CPU, a short context), built on
first use and shared by every request of the engine behind one lock, so ``compress_*`` may run
in worker threads (the server calls them with ``asyncio.to_thread``) while the main engine steps.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
import time
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

from pydantic import ValidationError

from lmplug.config import EngineConfig, resolve
from lmplug.engine.engine import LLMEngine
from lmplug.errors import ConfigError, LmplugError
from lmplug.interfaces.compressor import (
    CompressionInput,
    CompressionParams,
    CompressionReport,
    CompressionResult,
    Compressor,
    Scorer,
    Segment,
)
from lmplug.interfaces.params import SamplingParams
from lmplug.loading.cache import resolve_model

logger = logging.getLogger(__name__)

SCORER_KEYS = ("scorer", "scorer_max_len")
PROTECTED_ROLES = frozenset({"system", "developer"})
# Set by a caller that may give up (the server, when its client leaves): the scorer checks it
# between engine steps, so a compression nobody waits for stops within one step. A context
# variable, because the scorer is shared by requests and each runs in its own copied context.
CANCEL: ContextVar[threading.Event | None] = ContextVar("lmplug_compression_cancel", default=None)
MAX_COMPRESS_CHARS = 1 << 20  # characters of prompt (all message contents) one request may compress
_BLANK_LINE = re.compile(r"\n[ \t]*\n")


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


def split_text(text: str, protect: Sequence[str], final_question: bool = True) -> list[Segment]:
    """``text`` as segments: its last paragraph (when ``final_question``) and every occurrence of
    each ``protect`` string protected, the rest not."""
    marks = [False] * len(text)
    if final_question:
        last = _last_blank_line(text)
        for k in range(last.start() if last else 0, len(text)):  # with the blank line before it
            marks[k] = True
    for span in protect:
        covered = 0  # each character is marked once: linear, however the occurrences overlap
        for start in occurrences(text, span):
            end = start + len(span)
            if end > covered:
                first = max(start, covered)
                marks[first:end] = [True] * (end - first)
                covered = end
    return [Segment(text[a:b], flag) for flag, a, b in _runs(marks)]


def occurrences(text: str, span: str) -> list[int]:
    """Every start of ``span`` in ``text``, overlapping ones included, in O(len(text) + len(span)).

    ``str.find`` from each start + 1 costs len(span) per overlapping occurrence: 128k ``a`` with a
    64k ``a`` span was 64k x 64k steps. The Z-algorithm on ``span + text`` gives, at each text
    position, how far it agrees with ``span``; a span occurs where that is at least its length.
    """
    if not span or len(span) > len(text):
        return []
    if span[0] not in span[1:]:  # no two occurrences overlap, so find's cost is linear (and in C)
        found, at = [], text.find(span)
        while at >= 0:
            found.append(at)
            at = text.find(span, at + len(span))
        return found
    whole, n = span + text, len(span)
    z, left, right, found = [0] * len(whole), 0, 0, []
    for i in range(1, len(whole)):
        k = min(right - i, z[i - left]) if i < right else 0
        while i + k < len(whole) and whole[k] == whole[i + k] and k < n:
            k += 1
        z[i] = k
        if i + k > right:
            left, right = i, i + k
        if i >= n and k >= n:
            found.append(i - n)
    return found


def final_paragraph(text: str) -> str | None:
    """The final question ``split_text`` protects: the text's last paragraph, stripped."""
    last = _last_blank_line(text)
    return text[last.end() if last else 0:].strip() or None


def _last_blank_line(text: str) -> re.Match | None:
    """The blank line before ``text``'s last paragraph (trailing whitespace is not one)."""
    breaks = list(_BLANK_LINE.finditer(text.rstrip()))
    return breaks[-1] if breaks else None


def _runs(marks: list[bool]) -> list[tuple[bool, int, int]]:
    runs, start = [], 0
    for k in range(1, len(marks) + 1):
        if k == len(marks) or marks[k] != marks[start]:
            runs.append((marks[start], start, k))
            start = k
    return runs


class PromptCompressor:
    """Compression for one engine: settles each request's method and options, builds scorers on
    first use, compresses text prompts and chats, and reports (see the module)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.registry = engine.registry
        self.default = dict(engine.config.compression) if engine.config.compression is not None else None
        self._scorers: dict[tuple, EngineScorer] = {}
        self._compressors: dict[tuple, Compressor] = {}
        self._lock = threading.Lock()
        if self.default is not None:
            compressor = self.settle(None)[0]
            if compressor.needs_scorer and compressor.options.scorer is not None:
                try:
                    resolve_model(compressor.options.scorer)
                except LmplugError as exc:
                    raise ConfigError(f"compression.scorer: {exc}") from None

    @property
    def enabled_by_default(self) -> bool:
        return self.default is not None

    def count_tokens(self, text: str) -> int:
        """Target-model tokens of ``text`` (no special tokens): what the rate is measured in."""
        return len(self.engine.tokenizer.encode(text, add_special_tokens=False))

    # -- settling a request's method ---------------------------------------------------
    def settle(self, params: CompressionParams | None) -> tuple[Compressor, tuple[str, ...]]:
        """The compressor (with its options) and the protect strings for a request."""
        params = params or CompressionParams()
        default = self.default or {}
        method = params.method or default.get("method")
        if method is None:
            raise ConfigError("compression.method: no method given, and the engine config has no "
                              "`compression` section to take it from")
        try:
            info = self.registry.get("compression", method)
        except Exception as exc:  # noqa: BLE001 - PluginError, or a registry broken by some plugin
            raise ConfigError(f"compression.method: {exc}") from None
        base = {k: v for k, v in default.items() if k != "method"} if default.get("method") == method else \
            {k: v for k, v in default.items() if k in SCORER_KEYS}
        options = {**base, **params.options}
        if params.rate is not None:
            options["rate"] = params.rate
        try:
            opts = info.cls.Options(**options)
        except ValidationError as exc:
            err = exc.errors()[0]
            key = ".".join(str(p) for p in err["loc"])
            where = key if key in ("rate", *SCORER_KEYS) or key not in params.options else f"options.{key}"
            raise ConfigError(f"compression.{where}: {err['msg']} (got {err.get('input')!r}; method "
                              f"{method!r} takes: {', '.join(info.cls.Options.model_fields)})") from None
        key = (method, opts.model_dump_json())
        with self._lock:
            if key not in self._compressors:
                self._compressors[key] = info.cls(opts)
            return self._compressors[key], params.protect

    def scorer(self, compressor: Compressor) -> EngineScorer | None:
        if not compressor.needs_scorer:
            return None
        opts = compressor.options
        config = self.engine.config
        model, tokenizer = (config.model, config.tokenizer) if opts.scorer is None else (opts.scorer, None)
        key = (model, tokenizer, opts.scorer_max_len)
        with self._lock:
            if key not in self._scorers:
                scfg = EngineConfig.from_dict({
                    "model": model, "tokenizer": tokenizer, "device": "cpu", "dtype": "float32",
                    "max_model_len": opts.scorer_max_len, "seed": 0,
                    "scheduler": {"backend": "auto", "max_num_seqs": 8,
                                  "max_num_batched_tokens": max(2048, opts.scorer_max_len)},
                }, source="compression.scorer")
                self._scorers[key] = EngineScorer(scfg, opts.scorer_max_len)
            scorer = self._scorers[key]
        scorer.load()
        return scorer

    # -- compressing ---------------------------------------------------------------------
    def compress_text(self, prompt: str, params: CompressionParams | dict | None
                      ) -> tuple[str, CompressionReport]:
        """The compressed prompt and its report (``params`` None: the config's default)."""
        params = CompressionParams.coerce(params)
        compressor, protect = self.settle(params)
        _check_size([prompt])
        _check_protect(protect, [prompt])
        segments = split_text(prompt, protect)
        result, seconds, fallback = self._run(compressor, segments, final_paragraph(prompt))
        text = prompt if result is None else result.text
        before = len(self.engine.tokenizer.encode(prompt))
        after = before if result is None else len(self.engine.tokenizer.encode(text))
        return text, self._report(compressor, before, after, seconds, fallback)

    def compress_messages(self, messages: list[dict], params: CompressionParams | dict | None,
                          **template_kwargs: Any) -> tuple[list[dict], CompressionReport]:
        """The chat with its message contents compressed (the template is not applied here), and
        the report, whose token counts are of the rendered chat (``LLM.apply_chat_template``)."""
        params = CompressionParams.coerce(params)
        compressor, protect = self.settle(params)
        contents = [m.get("content") if isinstance(m, dict) else None for m in messages]
        _check_size([c for c in contents if isinstance(c, str)])
        _check_protect(protect, [c for c in contents if isinstance(c, str)])
        last_user = max((k for k, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"
                         and isinstance(contents[k], str)), default=None)
        segments: list[Segment] = []
        owners: list[int] = []
        for k, (message, content) in enumerate(zip(messages, contents)):
            if not isinstance(content, str) or not content:
                continue
            if message.get("role") in PROTECTED_ROLES:
                parts = [Segment(content, True)]
            else:
                parts = split_text(content, protect, final_question=k == last_user)
            segments.extend(parts)
            owners.extend([k] * len(parts))
        question = None if last_user is None else final_paragraph(contents[last_user])
        result, seconds, fallback = self._run(compressor, segments, question)
        out = [dict(m) if isinstance(m, dict) else m for m in messages]
        if result is not None:
            new = {k: "" for k in owners}
            for k, seg in zip(owners, result.segments):
                new[k] += seg.text
            for k, text in new.items():
                out[k]["content"] = text
        tok = self.engine.tokenizer
        before = len(tok.chat_ids(messages, add_generation_prompt=True, **template_kwargs))
        after = before if result is None else len(tok.chat_ids(out, add_generation_prompt=True, **template_kwargs))
        return out, self._report(compressor, before, after, seconds, fallback)

    def _run(self, compressor: Compressor, segments: list[Segment], question: str | None
             ) -> tuple[CompressionResult | None, float, str | None]:
        """The method's result (None: fell back), its seconds, and why it fell back."""
        scorer = self.scorer(compressor)  # a scorer that cannot load is an error, not a fallback
        request = CompressionInput(tuple(segments), compressor.options.rate, self.count_tokens, question)
        started = time.perf_counter()
        try:
            result = compressor.compress(request, scorer)
            _check_result(request, result)
        except CompressionCancelled:
            raise  # not a failure of the method: nobody wants the prompt, full or not
        except Exception as exc:  # noqa: BLE001 - any failure of a method falls back to the full prompt
            seconds = time.perf_counter() - started
            reason = f"{type(exc).__name__}: {exc}"
            logger.warning("compression %r failed, using the full prompt: %s", compressor.name, reason)
            return None, seconds, reason
        return result, time.perf_counter() - started, None

    def _report(self, compressor: Compressor, before: int, after: int, seconds: float,
                fallback: str | None) -> CompressionReport:
        return CompressionReport(compressor.name, compressor.options.rate, before, after, seconds, fallback)


def _check_size(texts: Sequence[str]) -> None:
    size = sum(len(t) for t in texts)
    if size > MAX_COMPRESS_CHARS:
        raise ConfigError(f"compression: a prompt of {size} characters; at most {MAX_COMPRESS_CHARS} can be "
                          "compressed (send it without compression, or shorter)")


def _check_protect(protect: Sequence[str], texts: Sequence[str]) -> None:
    for span in protect:
        if not any(span in t for t in texts):
            shown = span if len(span) <= 60 else span[:57] + "..."
            raise ConfigError(f"compression.protect: {shown!r} does not occur in the prompt")


def _check_result(request: CompressionInput, result: Any) -> None:
    """A method's result keeps the segments' number, order and protected texts."""
    if not isinstance(result, CompressionResult):
        raise TypeError(f"compress returned {type(result).__name__}, not a CompressionResult")
    if len(result.segments) != len(request.segments):
        raise ValueError(f"compress returned {len(result.segments)} segments for {len(request.segments)}")
    for before, after in zip(request.segments, result.segments):
        if not isinstance(after.text, str) or (before.protected and (after.text != before.text
                                                                      or not after.protected)):
            raise ValueError("compress changed a protected segment")
