"""The engine's side of structured output: compile at admission, one matcher per sequence, masks.

``Constraints`` holds the configured grammar engine (a ``ConstraintBackend``). A request with
``SamplingParams.structured`` is compiled before it is admitted, so a bad schema, regex or grammar
fails that request at once with an error naming the field. Compiles run in a ``CompilePool``
(worker processes, killed past ``max_compile_s``), never on the engine thread: the server asks for
the compile (``compile_async``) and admits the request when it is done (``pin`` then ``admit``),
while the other requests keep running; ``admit`` alone (the offline ``LLM``) waits for it. The
compiled constraint is pinned to its request until its first matcher exists, so the cache may
drop it (it is bounded in bytes) without a compile in the middle of a step. Each sequence gets its own
``Matcher`` when it first needs a mask (so ``n > 1`` siblings, forked at the first token, start from
the beginning like their parent did). A matcher is kept in step with its sequence lazily: before a
mask is filled, it accepts the output tokens it has not seen (``_sync``), so whatever appended them
(the sampler, the speculative verifier, a stop check that cut the output) the matcher follows the
tokens the sequence really kept, and a preempted sequence (recomputed, its tokens kept) loses
nothing.

Masks are filled for a whole step at once (``masks``): one bitmask row per logits row of a
constrained sequence. With drafts (speculative decoding), row ``j`` is the mask after the first ``j``
draft tokens: the matcher accepts them one by one and is rolled back afterwards; a draft token the
constraint forbids gets a masked probability of 0 from the target, so verification stops there and the
rows after it are never read (they repeat its mask). ``start``/``result`` run the filling on a worker
thread while the model's forward runs (the grammar engines release the GIL while they fill).
"""

from __future__ import annotations

import logging
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from lmplug.constraint_pool import CompilePool
from lmplug.interfaces.constraint import ConstraintBackend, ConstraintError, Matcher, new_bitmask
from lmplug.interfaces.sequence import Sequence

logger = logging.getLogger(__name__)



@dataclass
class StepMasks:
    """One step's masks: ``bitmask`` int32 [M, W] and ``rows`` long [M], the logits row of each
    mask row (None, None: no constrained row)."""

    bitmask: torch.Tensor | None
    rows: torch.Tensor | None


NO_MASKS = StepMasks(None, None)


class _State:
    __slots__ = ("compiled", "consumed", "matcher", "request_id")

    def __init__(self, request_id: str, compiled, matcher: Matcher) -> None:
        self.request_id = request_id
        self.compiled = compiled  # for the request's other sequences (n > 1)
        self.matcher = matcher
        self.consumed = 0  # output tokens the matcher has accepted


class Constraints:
    def __init__(self, backend: ConstraintBackend | None, vocab_size: int) -> None:
        self.backend = backend
        self.vocab_size = vocab_size
        self._states: dict[int, _State] = {}  # seq_id -> its matcher
        self._pins: dict[str, object] = {}  # request_id -> its compiled constraint, until a matcher has it
        self._pool: CompilePool | None = None
        self._pool_lock = threading.Lock()
        self._masks: ThreadPoolExecutor | None = None

    # -- requests ------------------------------------------------------------------------------
    def admit(self, params, request_id: str = "") -> None:
        """Compile the request's constraint, unless ``pin`` handed it over (waiting for the compile
        pool, or a cache hit); raises ``ConstraintError``."""
        spec = params.structured
        if spec is None or request_id in self._pins:
            return
        future = self.compile_async(spec)
        compiled = self.backend.cached(spec) if future is None else future.result()
        if request_id:
            self._pins[request_id] = compiled

    def compile_async(self, spec) -> Future | None:
        """A future of ``spec`` compiled in the pool (or of the ``ConstraintError`` refusing it);
        None when the cache holds it already."""
        if self.backend is None:
            raise ConstraintError("structured", "structured output was asked for, but no constraint backend "
                                  "is configured (config section `constraint`)")
        if self.backend.cached(spec) is not None:
            return None
        if spec.kind not in self.backend.kinds:
            self.backend.compile_cached(spec)  # raises the backend's error naming the kind
        return self._start_pool().submit(spec)

    def _start_pool(self) -> CompilePool:
        with self._pool_lock:
            if self._pool is None:
                options = self.backend.options
                self._pool = CompilePool(self.backend, options.compile_workers, options.compile_queue)
                # an engine dropped without close() (a test's, a notebook's) stops its workers too
                weakref.finalize(self, self._pool.close)
            return self._pool

    def pin(self, request_id: str, compiled) -> None:
        """Hold ``compiled`` for ``request_id`` (admitted next) until its first matcher exists."""
        self._pins[request_id] = compiled

    def unpin(self, request_id: str) -> None:
        self._pins.pop(request_id, None)

    def close(self) -> None:
        """Stop the compile workers."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def prepare_in_background(self) -> None:
        """The backend's one-off set-up (``ConstraintBackend.prepare``) on a daemon thread, and the
        compile workers started; a failure is logged, and the first constrained request then meets
        it and reports it."""
        if self.backend is None:
            return
        self._start_pool()

        def run() -> None:
            try:
                self.backend.prepare()
            except Exception:
                logger.warning("structured output: preparing the %r backend failed", self.backend.name,
                               exc_info=True)

        threading.Thread(target=run, name="lmplug-constraint-prepare", daemon=True).start()

    def release(self, seq: Sequence) -> None:
        self._states.pop(seq.seq_id, None)
        if seq.is_finished:  # aborted or ended before its first mask
            self._pins.pop(seq.request_id, None)

    def fork(self, src: Sequence, dst: Sequence) -> None:
        """``dst`` is about to take over ``src``'s tokens (a beam that descends from another; call
        it before ``dst.token_ids`` change). ``dst`` gets a copy of ``src``'s matcher
        (``Matcher.fork``); a matcher that cannot be copied is rolled back to the output both
        held and replays ``src``'s tokens from there at its next ``_sync`` (from the start when
        ``dst`` had none or cannot roll back that far)."""
        if not self.wanted(src):
            return
        state, mine = self._states.get(src.seq_id), self._states.pop(dst.seq_id, None)
        copy = None if state is None else state.matcher.fork()
        if copy is not None:
            self._states[dst.seq_id] = _State(dst.request_id, state.compiled, copy)
            self._states[dst.seq_id].consumed = state.consumed
            return
        if mine is None:
            return
        old, new = dst.token_ids[dst.num_prompt_tokens:], src.token_ids[src.num_prompt_tokens:]
        shared = next((i for i, (a, b) in enumerate(zip(old[:mine.consumed], new)) if a != b),
                      min(mine.consumed, len(new)))
        try:
            mine.matcher.rollback(mine.consumed - shared)
        except ValueError:  # past what it can undo: a fresh matcher replays everything
            return
        mine.consumed = shared
        self._states[dst.seq_id] = mine

    @staticmethod
    def wanted(seq: Sequence) -> bool:
        return seq.params.structured is not None

    # -- masks ---------------------------------------------------------------------------------
    def fill(self, seqs: list[Sequence], drafts: list[list[int]] | None = None,
             ) -> dict[int, torch.Tensor | Exception]:
        """For each constrained sequence: its mask rows, int32 [1 + len(draft), W] (row j: after the
        first j draft tokens), or the exception its matcher raised (reported per sequence).
        ``drafts[i]``: the draft tokens sequence i carries at the end of its ``token_ids`` (the
        speculator appends them for the forward); they are not output yet."""
        out: dict[int, torch.Tensor | Exception] = {}
        for i, seq in enumerate(seqs):
            if not self.wanted(seq):
                continue
            draft = [] if drafts is None else drafts[i]
            rows = new_bitmask(1 + len(draft), self.vocab_size)
            try:
                self._fill(seq, rows, draft)
                out[seq.seq_id] = rows
            except Exception as exc:  # noqa: BLE001  (reported per sequence through on_error)
                out[seq.seq_id] = exc
        return out

    def assemble(self, seqs: list[Sequence], num_rows: list[int],
                 filled: dict[int, torch.Tensor | Exception]) -> StepMasks:
        """One bitmask for the step's logits (sequence i owns ``num_rows[i]`` consecutive rows; its
        first rows take its filled masks). A constrained sequence missing from ``filled`` (a sibling
        forked this step) is filled now. Raises the matcher's exception if all sequences share one
        batch; callers redo one sequence at a time to isolate it."""
        parts, rows, start = [], [], 0
        for seq, n in zip(seqs, num_rows):
            if self.wanted(seq):
                mask = filled.get(seq.seq_id)
                if mask is None:
                    mask = self.fill([seq])[seq.seq_id]
                    filled[seq.seq_id] = mask
                if isinstance(mask, Exception):
                    raise mask
                parts.append(mask[:n])
                rows.append(torch.arange(start, start + min(n, mask.shape[0])))
            start += n
        if not parts:
            return NO_MASKS
        return StepMasks(torch.cat(parts), torch.cat(rows))

    def _fill(self, seq: Sequence, out: torch.Tensor, draft: list[int]) -> None:
        state = self._sync(seq, len(draft))
        state.matcher.fill_mask(out[0])
        accepted = 0
        for j, token in enumerate(draft, start=1):
            if not state.matcher.accept(token):
                out[j:] = out[j - 1]  # never read: the target cannot accept the forbidden draft j - 1
                break
            accepted += 1
            state.matcher.fill_mask(out[j])
        if accepted:
            state.matcher.rollback(accepted)

    def _sync(self, seq: Sequence, num_draft: int = 0) -> _State:
        state = self._states.get(seq.seq_id)
        if state is None:
            compiled = self._compiled_for(seq)
            state = self._states[seq.seq_id] = _State(seq.request_id, compiled, self.backend.matcher(compiled))
        output = seq.token_ids[seq.num_prompt_tokens:seq.num_tokens - num_draft]
        for token in output[state.consumed:]:
            if not state.matcher.accept(token):
                raise RuntimeError(f"structured output: token {token} of request {seq.request_id!r} is not "
                                   "allowed by its constraint (the matcher and the output diverged)")
            state.consumed += 1
        return state

    def _compiled_for(self, seq: Sequence):
        """The constraint compiled at admission: pinned, a sibling's, or (dropped since) the cache's."""
        compiled = self._pins.pop(seq.request_id, None)
        if compiled is not None:
            return compiled
        for state in self._states.values():
            if state.request_id == seq.request_id:
                return state.compiled
        return self.backend.compile_cached(seq.params.structured)

    # -- overlap with the forward --------------------------------------------------------------
    def start(self, seqs: list[Sequence], drafts: list[list[int]] | None = None) -> Future | None:
        """``fill`` on a worker thread, while the forward runs; None when no sequence is constrained."""
        if not any(self.wanted(s) for s in seqs):
            return None
        if self._masks is None:
            self._masks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmplug-masks")
        return self._masks.submit(self.fill, list(seqs), None if drafts is None else [list(d) for d in drafts])

    @staticmethod
    def result(job: Future | None) -> dict[int, torch.Tensor | Exception]:
        return {} if job is None else job.result()
