"""From OpenAI requests to engine inputs (prompt token ids, ``SamplingParams``), and engine
logprobs back to OpenAI's two logprob shapes.

Prompts are tokenized exactly as ``LLM`` does (``LLM.chat`` / ``LLM.generate``), so the
server's output for a seed equals the Python API's. Every error names the request field
it came from (``param``), including those the engine raises when it admits the request
(``admission_error``: a schema, regex or grammar that does not compile, a ``logit_bias``
token id past the vocabulary).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jinja2

from lmplug.beam.stage import BeamRequestError
from lmplug.errors import LmplugError
from lmplug.interfaces.constraint import ConstraintError, StructuredOutput
from lmplug.interfaces.params import SamplingParams
from lmplug.interfaces.sequence import Logprob
from lmplug.loading.tokenizer import Tokenizer
from lmplug.serve import tools as tool_calls
from lmplug.serve.errors import APIError
from lmplug.serve.protocol import (
    ChatCompletionRequest,
    ChatLogprobs,
    CompletionLogprobs,
    CompletionRequest,
    TokenLogprob,
    TopLogprob,
)

MAX_PROMPTS = 64  # prompts in one completions call
MAX_REQUEST_SEQS = 64  # sequences one HTTP request may queue: n x prompts


# -- prompts ---------------------------------------------------------------------------------------


def chat_prompt_ids(tokenizer: Tokenizer | None, req: ChatCompletionRequest,
                    tools: list[dict] | None = None, messages: list[dict] | None = None) -> list[int]:
    """The conversation through the model's chat template, as ``LLM.apply_chat_template`` does;
    ``tools`` (OpenAI's list, as HF templates expect it) are rendered too when given. ``messages``:
    the template's messages if already made (compressed), else ``template_messages(req)``."""
    if tokenizer is None or not tokenizer.chat_template:
        raise APIError(400, "messages: this model has no chat template; use /v1/completions",
                       param="messages")
    messages = template_messages(req) if messages is None else messages
    extra = {} if tools is None else {"tools": _utf8_deep(tools, "tools", "tools")}
    try:
        # the template writes the special tokens (BOS included); those in messages stay text
        return tokenizer.chat_ids(messages, add_generation_prompt=True, **extra)
    except (LmplugError, jinja2.TemplateError, TypeError) as exc:
        # TypeError: a template doing arithmetic on a field it did not expect (e.g. null content)
        raise APIError(400, f"messages: the chat template rejected them: {exc}", param="messages") from None


def template_messages(req: ChatCompletionRequest) -> list[dict]:
    """OpenAI messages -> the dicts chat templates read. ``developer`` becomes ``system``; tool
    calls and tool results go through ``tools.template_messages`` (arguments as a dict, as HF
    templates expect); a null ``content`` (an assistant turn that only called tools) is given to
    the template as "" so templates that concatenate content still render."""
    out = []
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if m.tool_calls is not None and m.role != "assistant":
            raise APIError(400, f"{where}.tool_calls: only assistant messages carry tool calls",
                           param=f"{where}.tool_calls")
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise APIError(400, f"{where}.content: required (null only on an assistant message with tool_calls)",
                           param=f"{where}.content")
        if m.role == "tool" and m.tool_call_id is None:
            raise APIError(400, f"{where}.tool_call_id: required on a tool message (the id of the call it "
                                "answers)", param=f"{where}.tool_call_id")
        if m.tool_call_id is not None and m.role != "tool":
            raise APIError(400, f"{where}.tool_call_id: only tool messages answer a call",
                           param=f"{where}.tool_call_id")
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                   "content": _utf8(m.text() or "", f"{where}.content", "messages")}
        if m.tool_calls:
            message["tool_calls"] = _utf8_deep([c.model_dump() for c in m.tool_calls], f"{where}.tool_calls",
                                               "messages")
        if m.tool_call_id is not None:
            message["tool_call_id"] = _utf8(m.tool_call_id, f"{where}.tool_call_id", "messages")
        out.append(message)
    try:
        return tool_calls.template_messages(out)
    except tool_calls.ToolError as exc:
        raise APIError(400, str(exc), param=exc.field) from None


def prompt_list(req: CompletionRequest) -> list:
    """The request's prompts as a list (each text or token ids)."""
    prompt = req.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


def completion_prompt_ids(tokenizer: Tokenizer | None, req: CompletionRequest,
                          vocab_size: int, prompts: list | None = None) -> list[list[int]]:
    """One list of token ids per prompt; text is encoded as ``LLM.generate`` encodes it.
    ``prompts``: the request's prompts if already taken out (compressed), else ``prompt_list(req)``."""
    prompts = prompt_list(req) if prompts is None else prompts
    if not prompts:
        raise APIError(400, "prompt: expected at least one prompt (got [])", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise APIError(400, f"prompt: at most {MAX_PROMPTS} prompts per request (got {len(prompts)})",
                       param="prompt")
    out = []
    for i, p in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            if tokenizer is None:
                raise APIError(400, f"{where}: this model has no tokenizer; send token ids", param="prompt")
            p = tokenizer.encode(_utf8(p, where, "prompt"))
        if not p:
            raise APIError(400, f"{where}: the prompt is empty", param="prompt")
        if min(p) < 0 or max(p) >= vocab_size:
            raise APIError(400, f"{where}: token ids must be in [0, {vocab_size})", param="prompt")
        out.append(p)
    return out


def _utf8(text: str, where: str, param: str) -> str:
    """``text`` if it is valid Unicode; a lone surrogate (JSON ``"\\udc80"``) is a 400."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"{where}: not valid Unicode (a lone surrogate {text[exc.start]!r} at "
                            f"character {exc.start}); send UTF-8 text", param=param) from None
    return text


def _utf8_deep(value: Any, where: str, param: str) -> Any:
    """``_utf8`` on every string inside ``value`` (tool definitions, tool calls)."""
    if isinstance(value, str):
        return _utf8(value, where, param)
    if isinstance(value, dict):
        for k, v in value.items():
            _utf8_deep(k, where, param)
            _utf8_deep(v, f"{where}.{k}", param)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _utf8_deep(v, f"{where}[{i}]", param)
    return value


def echo_texts(tokenizer: Tokenizer | None, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
    """What ``echo`` prepends to each prompt's choices: the prompt text as sent, or the text of
    its token ids."""
    sent = req.prompt
    if isinstance(sent, str) or (sent and isinstance(sent[0], int)):
        sent = [sent]
    names = TokenText(tokenizer)
    return [p if isinstance(p, str) else names.joined(ids) for p, ids in zip(sent, prompts)]


def check_request_size(req: ChatCompletionRequest | CompletionRequest, num_prompts: int) -> None:
    """One request queues at most ``MAX_REQUEST_SEQS`` sequences (``n`` x prompts)."""
    if req.n * num_prompts > MAX_REQUEST_SEQS:
        raise APIError(400, f"n: {req.n} samples x {num_prompts} prompts = {req.n * num_prompts} sequences, "
                            f"more than {MAX_REQUEST_SEQS} per request; lower n or send fewer prompts",
                       param="n")


# -- tools -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses tools. ``tools``: the checked definitions, rendered into the
    prompt; ``choice``: the effective tool_choice; ``constraint``: the JSON the output must be
    ("required" or a named function; the calls are read from it by ``tools.forced_calls``);
    ``parser``: reads calls out of free text ("auto"; None when the server's option is "none")."""

    tools: list[dict]
    choice: str | dict
    constraint: StructuredOutput | None
    parser: tool_calls.ToolParser | None

    @property
    def forced(self) -> bool:
        return self.constraint is not None

    @property
    def reads_calls(self) -> bool:
        """Whether the answer is searched for calls (not with "auto" and the parser option "none")."""
        return self.forced or self.parser is not None


def tool_plan(req: ChatCompletionRequest, parser: tool_calls.ToolParser | None) -> ToolPlan | None:
    """None when the request uses no tools (none given, or ``tool_choice: "none"``)."""
    try:
        tools = tool_calls.check_tools(req.tools) if req.tools is not None else None
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        constraint = tool_calls.constraint_for(tools, choice)
    except tool_calls.ToolError as exc:
        raise APIError(400, str(exc), param=exc.field) from None
    if not tools or choice == "none":
        return None
    if constraint is not None and req.parallel_tool_calls is False:
        constraint = _one_call(constraint)
    return ToolPlan(tools, choice, constraint, None if constraint is not None else parser)


def _one_call(constraint: StructuredOutput) -> StructuredOutput:
    """``parallel_tool_calls: false``: an array of calls ("required") holds exactly one."""
    schema = constraint.json if isinstance(constraint.json, dict) else None
    if schema is None or schema.get("type") != "array":
        return constraint  # a named function: one call already
    return StructuredOutput(json={**schema, "maxItems": 1})


# -- structured output -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Constraint:
    """The request's structured-output constraint and the request field it came from."""

    spec: StructuredOutput
    source: str


def structured_output(req: ChatCompletionRequest | CompletionRequest,
                      tools: ToolPlan | None = None) -> Constraint | None:
    """The one constraint the request asks for (``response_format``, a ``guided_*`` field,
    ``structured_outputs`` or a forced tool call), or None; more than one is a 400 naming them."""
    asked: list[tuple[str, dict]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(400, "response_format.json_schema: required when type is \"json_schema\"",
                           param="response_format.json_schema")
        asked.append(("response_format", {"json": fmt.json_schema.schema_}))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            asked.append((name, {kind: getattr(req, name)}))
    if req.structured_outputs is not None:
        given = {k: v for k, v in req.structured_outputs.model_dump(by_alias=True).items()
                 if v is not None and v is not False}
        if len(given) != 1:
            raise APIError(400, "structured_outputs: expected exactly one of json, regex, choice, grammar, "
                                f"json_object (got {', '.join(given) or 'none'})", param="structured_outputs")
        asked.append(("structured_outputs", given))
    if tools is not None and tools.constraint is not None:
        asked.append(("tool_choice", {"spec": tools.constraint}))
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise APIError(400, f"{names}: at most one structured-output constraint per request (got {len(asked)})",
                       param=asked[1][0])
    source, kwargs = asked[0]
    if "spec" in kwargs:  # tool calls: the schemas come from `tools`
        return Constraint(kwargs["spec"], "tools")
    try:
        return Constraint(StructuredOutput(**kwargs), source)
    except ConstraintError as exc:
        raise APIError(400, f"{source}: {_strip_params_prefix(str(exc))}", param=source) from None


def admission_error(exc: LmplugError, constraint: Constraint | None, beam_field: str = "n") -> APIError:
    """A 400 for what the engine refused when it admitted the request, naming the request field:
    the constraint's source for a constraint that does not compile, the field a beam search
    refusal blames (``beam_field``, best_of or n, for the beam width), the field a
    ``SamplingParams.<field>`` message names otherwise."""
    message = str(exc)
    if isinstance(exc, BeamRequestError):
        field = beam_field if exc.field == "beam_width" else exc.field
        return APIError(400, f"{field}: {message}", param=field)
    if constraint is not None and (isinstance(exc, ConstraintError) or "structured" in message):
        return APIError(400, f"{constraint.source}: {_strip_params_prefix(message)}", param=constraint.source)
    match = re.match(r"SamplingParams\.(\w+)", message)
    if match:
        return APIError(400, message.removeprefix("SamplingParams."), param=match.group(1))
    return APIError(400, message)


def _strip_params_prefix(message: str) -> str:
    """``SamplingParams.structured.json: not valid JSON`` -> ``not valid JSON``."""
    return re.sub(r"^SamplingParams\.structured(\.\w+)?: ", "", message)


# -- sampling --------------------------------------------------------------------------------------


def sampling_params(req: ChatCompletionRequest | CompletionRequest, prompts: list[list[int]],
                    max_model_len: int, default_max_tokens: int | None,
                    constraint: Constraint | None = None, tools: ToolPlan | None = None) -> SamplingParams:
    """Check the lengths against the context and build the params (bad values -> 400). A tool
    parser whose markers are special tokens gets them in the text (``keeps_special_tokens``)."""
    bad = req.unsupported()
    if bad:
        raise APIError(400, f"{bad[0]}: not supported by lmplug (leave it unset or at its default)",
                       param=bad[0], code="unsupported_parameter")
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of < req.n:
        raise APIError(400, f"best_of: {best_of}, but it must be >= n ({req.n})", param="best_of")
    if best_of is not None and best_of > req.n and req.stream:  # as OpenAI: the best are known only at the end
        raise APIError(400, f"best_of: {best_of} > n ({req.n}) cannot be streamed (stream: true)", param="best_of")
    check_request_size(req, len(prompts))
    longest = max(len(p) for p in prompts)
    if longest >= max_model_len:
        raise APIError(400, f"prompt: {longest} tokens, but max_model_len={max_model_len} leaves room for "
                       f"at most {max_model_len - 1} prompt tokens", param="prompt",
                       code="context_length_exceeded")
    room = max_model_len - longest
    max_tokens = req.max_new_tokens
    name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens > room:
        raise APIError(400, f"{name}: {max_tokens}, but the prompt ({longest} tokens) + {name} must be "
                       f"<= max_model_len={max_model_len}, so at most {room}", param=name,
                       code="context_length_exceeded")
    try:
        return SamplingParams(
            n=req.n, max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            min_p=req.min_p, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos, include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=req.num_logprobs, prompt_logprobs=req.num_prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens and not (
                tools is not None and tools.parser is not None and tools.parser.keeps_special_tokens),
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias or None,
            min_tokens=req.min_tokens, structured=None if constraint is None else constraint.spec,
            exact=req.exact, beam_width=req.beam_width, length_penalty=req.length_penalty,
            early_stopping=req.early_stopping, denoising=req.denoising,
            best_of=None if req.use_beam_search or best_of == req.n else best_of)
    except LmplugError as exc:
        # "SamplingParams.top_k=-3 is invalid: ..." -> "top_k=-3 is invalid: ..."
        message = str(exc).removeprefix("SamplingParams.")
        raise APIError(400, message, param=re.match(r"\w*", message).group() or None) from None


# -- logprobs --------------------------------------------------------------------------------------


class TokenText:
    """Token id -> its text, cached (logprob entries name every top token)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token_id: int) -> str:
        if self._tokenizer is None:
            return f"<{token_id}>"
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def joined(self, token_ids: list[int]) -> str:
        """The text of several tokens decoded together (a prompt sent as token ids)."""
        if self._tokenizer is None:
            return "".join(self.text(t) for t in token_ids)
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)


def _top(row: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    return sorted(((t, lp) for t, lp in row.items() if lp.rank <= k), key=lambda x: x[1].rank)


def chat_logprobs(token_ids: list[int], rows: list[dict[int, Logprob]], k: int,
                  names: TokenText) -> ChatLogprobs:
    content = []
    for tid, row in zip(token_ids, rows):
        s = names.text(tid)
        top = [TopLogprob(token=names.text(t), logprob=lp.logprob, bytes=list(names.text(t).encode()))
               for t, lp in _top(row, k)]
        content.append(TokenLogprob(token=s, logprob=row[tid].logprob, bytes=list(s.encode()), top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(token_ids: list[int], rows: list[dict[int, Logprob] | None], k: int, names: TokenText,
                        text_offset: int) -> CompletionLogprobs:
    """``text_offset`` is where the first of these tokens starts in the choice's text. A row of
    None (the first prompt token with ``echo``: nothing predicts it) has no logprobs."""
    out = CompletionLogprobs()
    for tid, row in zip(token_ids, rows):
        s = names.text(tid)
        out.tokens.append(s)
        out.token_logprobs.append(None if row is None else row[tid].logprob)
        out.top_logprobs.append(None if row is None else {names.text(t): lp.logprob for t, lp in _top(row, k)})
        out.text_offset.append(text_offset)
        text_offset += len(s)
    return out
