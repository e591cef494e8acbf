"""Engine updates -> OpenAI responses: whole bodies, or SSE chunks ending in ``data: [DONE]``.

``ChatFormat`` and ``CompletionFormat`` know each endpoint's shapes; ``stream_events`` and
``collect`` drive a ``RequestGroup`` with either. Choice ``i`` of prompt ``p`` is choice
``p * n + i`` of the response, as OpenAI numbers them.

Tool calls (chat): with ``tool_choice: "auto"`` the server's tool parser reads calls out of
the text, streamed as it arrives (``ToolParser.streamer``); with "required" or a named
function the output is constrained JSON, and its calls are sent whole when the choice ends
(the arguments are re-serialised then, so nothing is streamed before). A choice that made
calls ends with ``finish_reason: "tool_calls"``. Echo (completions): the prompt's text, and
with ``logprobs`` its tokens' logprobs (the first is null), come before the completion's;
streamed, they are each choice's first chunk.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pydantic import BaseModel

from lmplug.serve import tools as tool_calls
from lmplug.serve.convert import TokenText, ToolPlan, chat_logprobs, completion_logprobs
from lmplug.serve.errors import APIError
from lmplug.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    DeltaFunction,
    DeltaMessage,
    DeltaToolCall,
    ResponseFunction,
    ResponseToolCall,
    SpeculativeUsage,
    Usage,
)
from lmplug.serve.request_group import ChoiceDelta, RequestGroup, Update


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
        self.prompt_logprobs: dict[int, list] = {}  # per prompt, when asked for (echo)
        self.prompt_tokens_before_compression: int | None = None  # set when the prompts were compressed
        self.speculative: SpeculativeUsage | None = None  # summed over the group's requests

    def add(self, update: Update) -> list[tuple[int, ChoiceDelta, int]]:
        """Fold in an update; return (response index, delta, text offset before it) per delta."""
        self.prompt_tokens[update.prompt_index] = update.num_prompt_tokens
        if update.prompt_logprobs is not None:
            self.prompt_logprobs[update.prompt_index] = update.prompt_logprobs
        m = update.metrics
        if m is not None and m.acceptance_rule is not None:
            drafted = m.num_drafted_tokens + (self.speculative.drafted_tokens if self.speculative else 0)
            accepted = m.num_accepted_tokens + (self.speculative.accepted_tokens if self.speculative else 0)
            self.speculative = SpeculativeUsage(acceptance_rule=m.acceptance_rule, lossy=m.lossy,
                                                drafted_tokens=drafted, accepted_tokens=accepted)
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
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_before_compression=self.prompt_tokens_before_compression,
                     speculative=self.speculative)


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

    def __init__(self, model: str, num_logprobs: int | None, names: TokenText,
                 tools: ToolPlan | None = None) -> None:
        super().__init__(model, num_logprobs, names)
        self.tools = tools if tools is not None and tools.reads_calls else None
        self._streamers: dict[int, tool_calls.ToolStreamer] = {}  # choice -> its parser state (auto)
        self._called: set[int] = set()  # choices that streamed a tool call

    def opening(self, num_choices: int) -> list[BaseModel]:
        """OpenAI's first chunk of each choice carries the role and an empty content."""
        return [self._chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                for i in range(num_choices)]

    def chunks(self, index: int, delta: ChoiceDelta, offset: int, acc: Accumulator) -> list[BaseModel]:
        logprobs = None
        if self.num_logprobs is not None and delta.token_ids:
            logprobs = chat_logprobs(delta.token_ids, delta.logprobs or [], self.num_logprobs, self.names)
        finish = delta.finish_reason
        if self.tools is None:
            message = DeltaMessage(content=delta.text) if delta.text or not finish else DeltaMessage()
        else:
            message = self._tool_delta(index, delta, acc.choices[index].text)
            if finish and index in self._called and finish != "abort":
                finish = "tool_calls"
            if not (message.content or message.tool_calls or logprobs or finish):
                return []  # held back: it may be part of a call
        return [self._chunk([ChatChunkChoice(index=index, delta=message, logprobs=logprobs,
                                             finish_reason=finish)])]

    def _tool_delta(self, index: int, delta: ChoiceDelta, text_so_far: str) -> DeltaMessage:
        """What the client sees of this delta when tools are in play (None of it, for a forced call
        still being written)."""
        if self.tools.forced:
            if not delta.finish_reason:
                return DeltaMessage()
            content, calls = self._calls(text_so_far)
            pieces = [tool_calls.ToolDelta(content=content)] + [
                tool_calls.ToolDelta(index=i, id=c.id, name=c.name, arguments=c.arguments) for i, c in enumerate(calls)]
        else:
            streamer = self._streamers.setdefault(index, self.tools.parser.streamer(self.tools.tools))
            pieces = streamer.feed(delta.text) if delta.text else []
            if delta.finish_reason:
                pieces += streamer.finish()
        message = _merge(pieces)
        if message.tool_calls:
            self._called.add(index)
        return message

    def _calls(self, text: str) -> tuple[str | None, list[tool_calls.ToolCall]]:
        """(content, calls) of one choice's whole text."""
        if self.tools is None:
            return text, []
        if not self.tools.forced:
            return self.tools.parser.parse(text, self.tools.tools)
        try:
            return None, tool_calls.forced_calls(text, self.tools.tools, self.tools.choice)
        except tool_calls.ToolError:
            # only an output cut short (max_tokens) is not whole JSON: it comes back as text
            return text, []

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
            content, calls = self._calls(c.text)
            finish = "tool_calls" if calls and c.finish_reason != "abort" else c.finish_reason
            message = AssistantMessage(content=content, tool_calls=[
                ResponseToolCall(id=call.id, function=ResponseFunction(name=call.name, arguments=call.arguments))
                for call in calls] or None)
            choices.append(ChatChoice(index=i, message=message, logprobs=logprobs, finish_reason=finish))
        return ChatCompletion(id=self.id, created=self.created, model=self.model, choices=choices,
                              usage=acc.usage())


def _merge(pieces: list[tool_calls.ToolDelta]) -> DeltaMessage:
    """A parser's pieces -> one delta: the content joined, one entry per call (its first piece
    carries id, type and name; arguments fragments are concatenated)."""
    content = "".join(p.content for p in pieces if p.content) or None
    calls: dict[int, DeltaToolCall] = {}
    for p in pieces:
        if p.index is None:
            continue
        call = calls.get(p.index)
        if call is None:
            first = p.id is not None
            calls[p.index] = DeltaToolCall(index=p.index, id=p.id, type="function" if first else None,
                                           function=DeltaFunction(name=p.name, arguments=p.arguments or ""))
        else:
            call.function.arguments = (call.function.arguments or "") + (p.arguments or "")
    return DeltaMessage(content=content, tool_calls=list(calls.values()) or None)


class CompletionFormat(_Format):
    prefix = "cmpl"

    def __init__(self, model: str, num_logprobs: int | None, names: TokenText,
                 echo: list[str] | None = None, prompts: list[list[int]] | None = None) -> None:
        """``echo``: each prompt's text, prepended to its choices (``prompts``: its token ids)."""
        super().__init__(model, num_logprobs, names)
        self.echo = echo
        self.prompts = prompts
        self._echoed: set[int] = set()

    def chunks(self, index: int, delta: ChoiceDelta, offset: int, acc: Accumulator) -> list[BaseModel]:
        out = []
        start = 0
        if self.echo is not None:
            prompt = index // acc.n
            start = len(self.echo[prompt])
            if index not in self._echoed:
                self._echoed.add(index)
                out.append(self._chunk(CompletionChoice(index=index, text=self.echo[prompt],
                                                        logprobs=self._prompt_logprobs(prompt, acc))))
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = completion_logprobs(delta.token_ids, delta.logprobs or [], self.num_logprobs,
                                           self.names, start + offset)
        out.append(self._chunk(CompletionChoice(index=index, text=delta.text, logprobs=logprobs,
                                                finish_reason=delta.finish_reason)))
        return out

    def _prompt_logprobs(self, prompt: int, acc: Accumulator) -> CompletionLogprobs | None:
        if self.num_logprobs is None:
            return None
        ids = self.prompts[prompt]
        rows = acc.prompt_logprobs.get(prompt) or [None] * len(ids)
        return completion_logprobs(ids, rows, self.num_logprobs, self.names, 0)

    def _chunk(self, choice: CompletionChoice) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=[choice])

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def response(self, acc: Accumulator) -> BaseModel:
        choices = []
        for i, c in enumerate(acc.choices):
            echo = "" if self.echo is None else self.echo[i // acc.n]
            logprobs = None
            if self.num_logprobs is not None:
                logprobs = completion_logprobs(c.token_ids, c.logprobs, self.num_logprobs, self.names, len(echo))
                if self.echo is not None:
                    logprobs = _joined(self._prompt_logprobs(i // acc.n, acc), logprobs)
            choices.append(CompletionChoice(index=i, text=echo + c.text, logprobs=logprobs,
                                            finish_reason=c.finish_reason))
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices,
                          usage=acc.usage())


def _joined(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=first.tokens + then.tokens,
                              token_logprobs=first.token_logprobs + then.token_logprobs,
                              top_logprobs=first.top_logprobs + then.top_logprobs,
                              text_offset=first.text_offset + then.text_offset)


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
                    for chunk in fmt.chunks(index, delta, offset, acc):
                        yield sse(chunk)
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
