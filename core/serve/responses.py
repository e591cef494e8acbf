"""Engine updates -> OpenAI responses: whole bodies, or SSE chunks ending in ``data: [DONE]``.

``ChatFormat`` and ``CompletionFormat`` know each endpoint's shapes; ``stream_events`` and
``collect`` drive a ``RequestGroup`` with either. Choice ``i`` of prompt ``p`` is choice
``p * n + i`` of the response, as OpenAI numbers them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pydantic import BaseModel

from lmplug.serve.async_engine import ChoiceDelta, RequestGroup, Update
from lmplug.serve.convert import TokenText, chat_logprobs, completion_logprobs
from lmplug.serve.errors import APIError
from lmplug.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    DeltaMessage,
    Usage,
)


@dataclass
class ChoiceState:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None


class Accumulator:
    """Everything the updates of one group said, per response choice, plus the usage counts."""

    def __init__(self, num_prompts: int, n: int) -> None:
        self.n = n
        self.choices = [ChoiceState() for _ in range(num_prompts * n)]
        self.prompt_tokens: dict[int, int] = {}

    def add(self, update: Update) -> list[tuple[int, ChoiceDelta, int]]:
        """Fold in an update; return (response index, delta, text offset before it) per delta."""
        self.prompt_tokens[update.prompt_index] = update.num_prompt_tokens
        out = []
        for delta in update.choices:
            index = update.prompt_index * self.n + delta.index
            state = self.choices[index]
            out.append((index, delta, len(state.text)))
            state.text += delta.text
            state.token_ids += delta.token_ids
            state.logprobs += delta.logprobs or []
            state.finish_reason = delta.finish_reason or state.finish_reason
        return out

    def usage(self) -> Usage:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(len(c.token_ids) for c in self.choices)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class _Format:
    prefix = ""

    def __init__(self, model: str, num_logprobs: int | None, names: TokenText) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.num_logprobs = num_logprobs
        self.names = names

    def opening(self, num_choices: int) -> list[BaseModel]:
        return []


class ChatFormat(_Format):
    prefix = "chatcmpl"

    def opening(self, num_choices: int) -> list[BaseModel]:
        """OpenAI's first chunk of each choice carries the role and an empty content."""
        return [self._chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                for i in range(num_choices)]

    def chunk(self, index: int, delta: ChoiceDelta, offset: int) -> BaseModel:
        logprobs = None
        if self.num_logprobs is not None and delta.token_ids:
            logprobs = chat_logprobs(delta.token_ids, delta.logprobs or [], self.num_logprobs, self.names)
        content = DeltaMessage(content=delta.text) if delta.text or not delta.finish_reason else DeltaMessage()
        return self._chunk([ChatChunkChoice(index=index, delta=content, logprobs=logprobs,
                                            finish_reason=delta.finish_reason)])

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage)

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                   usage=usage)

    def response(self, acc: Accumulator) -> BaseModel:
        choices = []
        for i, c in enumerate(acc.choices):
            logprobs = None
            if self.num_logprobs is not None:
                logprobs = chat_logprobs(c.token_ids, c.logprobs, self.num_logprobs, self.names)
            choices.append(ChatChoice(index=i, message=AssistantMessage(content=c.text), logprobs=logprobs,
                                      finish_reason=c.finish_reason))
        return ChatCompletion(id=self.id, created=self.created, model=self.model, choices=choices,
                              usage=acc.usage())


class CompletionFormat(_Format):
    prefix = "cmpl"

    def chunk(self, index: int, delta: ChoiceDelta, offset: int) -> BaseModel:
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = completion_logprobs(delta.token_ids, delta.logprobs or [], self.num_logprobs,
                                           self.names, offset)
        choice = CompletionChoice(index=index, text=delta.text, logprobs=logprobs,
                                  finish_reason=delta.finish_reason)
        return Completion(id=self.id, created=self.created, model=self.model, choices=[choice])

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def response(self, acc: Accumulator) -> BaseModel:
        choices = []
        for i, c in enumerate(acc.choices):
            logprobs = None
            if self.num_logprobs is not None:
                logprobs = completion_logprobs(c.token_ids, c.logprobs, self.num_logprobs, self.names, 0)
            choices.append(CompletionChoice(index=i, text=c.text, logprobs=logprobs,
                                            finish_reason=c.finish_reason))
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices,
                          usage=acc.usage())


def sse(payload: BaseModel | str) -> str:
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


async def stream_events(group: RequestGroup, fmt: _Format, acc: Accumulator,
                        include_usage: bool) -> AsyncIterator[str]:
    """The SSE body: chunks as tokens arrive, the usage chunk if asked, ``[DONE]``.
    An engine error after the headers went out is sent as an ``{"error": ...}`` event."""
    async with group:
        try:
            for chunk in fmt.opening(len(acc.choices)):
                yield sse(chunk)
            async for update in group:
                for index, delta, offset in acc.add(update):
                    yield sse(fmt.chunk(index, delta, offset))
        except APIError as exc:
            yield sse(exc.body())
            yield sse("[DONE]")
            return
    if include_usage:
        yield sse(fmt.usage_chunk(acc.usage()))
    yield sse("[DONE]")


async def collect(group: RequestGroup, fmt: _Format, acc: Accumulator) -> BaseModel:
    async with group:
        async for update in group:
            acc.add(update)
    return fmt.response(acc)
