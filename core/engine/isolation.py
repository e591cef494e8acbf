"""One request's failure stays its own; one plugin's observer failure reaches no request.

``StepFailures`` runs the per-sequence work of a step's commit (selecting tokens, logprobs,
appending tokens) so that an exception fails the sequence it came from, not the step: the
sequence ends with ``finish_reason="error"`` and the engine ends its request. ``Observers``
calls a lifecycle hook implementation by implementation and logs, once per plugin and hook,
one that raises.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from lmplug.interfaces.sequence import Sequence
from lmplug.outputs.logprobs import token_logprobs

logger = logging.getLogger("lmplug.engine.engine")


class StepFailures:
    """The sequences of one step that failed, and the guarded calls that put them there."""

    def __init__(self) -> None:
        self.failed: list[Sequence] = []

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self.failed

    def guarded(self, seq: Sequence, what: str, fn: Callable, *args):
        """``fn(*args)``; if it raises, ``seq`` fails and the result is None."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001  (one request's failure; logged by fail)
            self.fail(seq, what, exc)
            return None

    def fail(self, seq: Sequence, what: str, exc: BaseException) -> None:
        logger.error("request %r failed in the %s stage; it ends with finish_reason='error' "
                     "(the other requests go on)", seq.request_id, what, exc_info=exc)
        seq.finish("error", clear_stop_reason=True, at=time.perf_counter())
        if seq not in self.failed:
            self.failed.append(seq)

    def select(self, selector, logits: torch.Tensor, num_rows: list[int], seqs: list[Sequence],
               hidden: torch.Tensor | None) -> tuple[list[list[int]], list[list[int]]]:
        """The select stage (sampler or speculator); a sequence it cannot serve fails alone."""
        return selector.select(logits, num_rows, seqs, hidden,
                               on_error=lambda seq, exc: self.fail(seq, "select", exc))

    def logprobs(self, logits: torch.Tensor, seqs: list[Sequence], emitted: list[list[int]],
                 rows: list[list[int]], tokenizer) -> list[list[dict] | None]:
        """The step's logprobs in one call; one sequence at a time if that raises."""
        try:
            return token_logprobs(logits, seqs, emitted, rows, tokenizer)
        except Exception:  # noqa: BLE001  (one request's failure; logged by fail)
            return [(self.guarded(s, "logprobs", token_logprobs, logits, [s], [e], [r], tokenizer)
                     or [None])[0] for s, e, r in zip(seqs, emitted, rows)]


class Observers:
    """The lifecycle hooks (``lmplug_engine_started``, ``lmplug_step_finished``,
    ``lmplug_request_finished``), called implementation by implementation."""

    def __init__(self, registry) -> None:
        self.registry = registry
        self._logged: set[tuple[str, str]] = set()  # (plugin, hook) already reported

    def wanted(self, hook: str) -> bool:
        return bool(self.registry.implementers(hook))

    def notify(self, hook: str, **kwargs) -> None:
        """Each plugin's implementation through pluggy's hook relay (wrappers honoured); one that
        raises is logged once per plugin and hook, and the others still run."""
        for plugin, _, exc in self.registry.call_each(hook, **kwargs):
            if exc is None or (plugin, hook) in self._logged:
                continue
            self._logged.add((plugin, hook))
            logger.error("plugin %r (distribution %s): its %s hook raised; ignored (logged once per "
                         "plugin and hook)", plugin, self.registry.distribution(plugin), hook,
                         exc_info=(type(exc), exc, exc.__traceback__))
