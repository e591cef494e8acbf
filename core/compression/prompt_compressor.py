"""``PromptCompressor``: prompt compression for one engine, request by request.

It settles each request's method and options (the request's ``CompressionParams`` over the
config's ``compression:`` section), builds the scorer it needs on first use, cuts the prompt or
the chat's message contents into segments, runs the method (a method that raises, or changes a
protected segment, falls back to the full prompt) and reports (``CompressionReport``). The
package docstring (``lmplug.compression``) says what is protected and why.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from pydantic import ValidationError

from lmplug.compression.scorer import CompressionCancelled, EngineScorer
from lmplug.compression.segments import check_protect, check_size, final_paragraph, split_text
from lmplug.config import EngineConfig
from lmplug.engine.engine import LLMEngine
from lmplug.errors import ConfigError, LmplugError
from lmplug.interfaces.compressor import (
    CompressionInput,
    CompressionParams,
    CompressionReport,
    CompressionResult,
    Compressor,
    Segment,
)
from lmplug.loading.cache import resolve_model

logger = logging.getLogger("lmplug.compression")  # the name its records had before the split

SCORER_KEYS = ("scorer", "scorer_max_len")
PROTECTED_ROLES = frozenset({"system", "developer"})


class PromptCompressor:
    """Compression for one engine: settles each request's method and options, builds scorers on
    first use, compresses text prompts and chats, and reports (see the package)."""

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
        check_size([prompt])
        check_protect(protect, [prompt])
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
        check_size([c for c in contents if isinstance(c, str)])
        check_protect(protect, [c for c in contents if isinstance(c, str)])
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
