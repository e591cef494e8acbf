"""The OpenAI API's request and response bodies (chat.completions and completions).

Requests are validated strictly (``strict=True``: ``"0.5"`` is not a number,
``1.0`` is not an integer) and unknown fields are refused, as OpenAI does, so a
misspelt option fails with a 400 naming it instead of being silently ignored.
The few fields OpenAI defines that lmplug cannot honour (``suffix``) are accepted only at their
neutral value.

Structured output comes in three spellings, at most one per request: OpenAI's
``response_format`` (``json_object``, or ``json_schema``: the schema constrains the output
whether ``strict`` is true or false), vLLM's ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``, and vLLM's newer ``structured_outputs`` object.
Chat requests may carry OpenAI ``tools`` / ``tool_choice``, assistant messages with
``tool_calls`` and ``tool`` messages answering them.
Responses are built as these models and sent with ``model_dump_json``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

_STRICT = ConfigDict(extra="forbid", strict=True)
Role = Literal["system", "developer", "user", "assistant", "tool"]


# -- requests ----------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str  # JSON text, as the API returned it


class MessageToolCall(BaseModel):
    """A call an earlier assistant turn made (sent back with the conversation)."""

    model_config = _STRICT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """``content`` may be null only on an assistant message with ``tool_calls``; a ``tool``
    message names the call it answers (``tool_call_id``). Checked in ``convert``, where the
    error can name the exact field."""

    model_config = _STRICT
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JsonSchemaFormat(BaseModel):
    model_config = _STRICT
    name: str
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None  # true or false: lmplug constrains the output to the schema either way


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of the fields."""

    model_config = _STRICT
    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingFields(BaseModel):
    """Fields both endpoints share; the ``lmplug`` extensions follow vLLM's names."""

    model_config = _STRICT
    model: str | None = None  # default: the served model
    # lmplug: prompt compression (``lmplug.serve.compress``): a method name, {method, rate, protect,
    # options}, true (the config's default) or false; absent: the config's default, if any
    compression: str | bool | dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=64)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # {"token id": bias}, as OpenAI sends it
    response_format: ResponseFormat | None = None
    # extensions (vLLM's names)
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    # lmplug: sample the target distribution exactly (refused when the server verifies drafts with a lossy
    # acceptance rule)
    exact: bool = False
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # beam search (vLLM's names): beam width best_of (completions) or n, n beams returned
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    # lmplug: block diffusion (``DenoisingParams`` fields: max_denoising_steps, t_min, t_max, ...)
    denoising: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        """Fields set to something lmplug cannot do (each becomes a 400 naming it)."""
        return []

    @property
    def beam_width(self) -> int:
        """0: no beam search."""
        return (getattr(self, "best_of", None) or self.n) if self.use_beam_search else 0


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None  # checked by ``lmplug.serve.tools.check_tools``
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: tool_choice "required" makes exactly one call

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def num_prompt_logprobs(self) -> int | None:
        return None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.suffix:
            bad.append("suffix")
        return bad

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """``echo`` with ``logprobs``: the prompt's tokens come first in the logprobs, with theirs."""
        return self.logprobs if self.echo else None


# -- responses ---------------------------------------------------------------------------------


class SpeculativeUsage(BaseModel):
    """An lmplug extension: how speculative decoding decided the response's tokens. ``lossy``: the
    acceptance rule may depart from the target distribution (``lmplug.interfaces.acceptance``)."""

    acceptance_rule: str
    lossy: bool
    drafted_tokens: int
    accepted_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # lmplug extensions, sent only when set: the prompt was compressed (the ``compression``
    # field); the server decodes speculatively
    prompt_tokens_before_compression: int | None = None
    speculative: SpeculativeUsage | None = None

    @model_serializer(mode="wrap")
    def _without_unset(self, handler: Any) -> dict:
        data = handler(self)
        for key in ("prompt_tokens_before_compression", "speculative"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class ResponseFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: the answer is only tool calls
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of call ``index``: its first piece carries id, type and name; later ones
    append to ``function.arguments``."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """Both the whole response and, with ``usage=None`` and text deltas, each streamed chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "lmplug"
    max_model_len: int
    root: str | None = None  # a LoRA adapter's folder (vLLM's field)
    parent: str | None = None  # a LoRA adapter's base model; None: a base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
