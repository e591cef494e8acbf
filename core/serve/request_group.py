"""What a handler holds while its requests run: ``RequestGroup`` and the ``Update`` it yields.

The event-loop half of ``AsyncEngine`` (``async_engine.py``): the engine thread hands per-choice
deltas over as ``Update`` objects into a group's ``asyncio.Queue``; the group resolves its
admission, ends iteration once every engine request finished, and aborts what still runs when
its handler leaves. Kept apart from the engine thread so the response writers (``responses.py``)
depend only on these types.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from typing_extensions import Self

from lmplug.errors import LmplugError
from lmplug.interfaces.sequence import Logprob
from lmplug.outputs import RequestMetrics
from lmplug.serve.errors import APIError

if TYPE_CHECKING:
    from lmplug.serve.async_engine import AsyncEngine


@dataclass
class ChoiceDelta:
    """What one sample added since the previous update."""

    index: int  # the sample's index within its engine request (0 .. n-1)
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None  # set on the sample's last delta


@dataclass
class Update:
    request_id: str
    prompt_index: int  # which prompt of the group
    num_prompt_tokens: int
    choices: list[ChoiceDelta]
    finished: bool  # the whole engine request is done
    error: APIError | None = None
    # with SamplingParams.prompt_logprobs: the prompt's logprobs (entry 0 None), on the first
    # update that has generated tokens (the prompt is complete then)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # on the finishing update: the request's metrics (the usage reports its speculative decoding)
    metrics: RequestMetrics | None = None
    embedding: list[float] | None = None  # an embedding request's vector (``AsyncEngine.embed``)


class RequestGroup:
    """Engine requests whose updates share one queue. Use as ``async with``: leaving the block
    early (client gone, error, cancellation) aborts whatever is still running."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str], num_seqs: int = 0,
                 on_refused: Callable[[LmplugError], APIError] | None = None) -> None:
        self._engine = engine
        self.request_ids = request_ids
        self.num_seqs = num_seqs  # sequences it holds (n x prompts), for the server-wide limit
        self.on_refused = on_refused  # called on the engine thread: must not touch the event loop
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self._unfinished = set(request_ids)
        self._to_admit = len(request_ids)
        self._admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def admitted(self) -> None:
        """Wait until the engine has taken every request of the group; raise the ``APIError`` of
        the first it refused (the others are aborted when the group closes)."""
        await self._admitted

    def _admission(self, error: APIError | None) -> None:
        """Event loop side: one request was taken (``error`` None) or refused."""
        if self._admitted.done():
            return
        self._to_admit -= 1
        if error is not None:
            self._admitted.set_exception(error)
        elif self._to_admit == 0:
            self._admitted.set_result(None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._unfinished:
            self._engine.abort(sorted(self._unfinished))
            self._unfinished.clear()
        self._engine._groups.discard(self)

    async def __aiter__(self) -> AsyncIterator[Update]:
        while self._unfinished:
            update = await self.queue.get()
            if update.error is not None:
                self._unfinished.discard(update.request_id)
                raise update.error
            if update.finished:
                self._unfinished.discard(update.request_id)
            yield update

