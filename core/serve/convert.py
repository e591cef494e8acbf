"""From OpenAI requests to engine inputs (prompt token ids, ``SamplingParams``), and engine
logprobs back to OpenAI's two logprob shapes.

Prompts are tokenized exactly as ``LLM`` does (``LLM.chat`` / ``LLM.generate``), so the
server's output for a seed equals the Python API's.
"""

from __future__ import annotations

from functools import lru_cache

import jinja2

from lmplug.errors import LmplugError
from lmplug.interfaces.params import SamplingParams
from lmplug.interfaces.sequence import Logprob
from lmplug.loading.tokenizer import Tokenizer
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


def chat_prompt_ids(tokenizer: Tokenizer | None, req: ChatCompletionRequest) -> list[int]:
    """The conversation through the model's chat template, as ``LLM.apply_chat_template`` does."""
    if tokenizer is None or not tokenizer.chat_template:
        raise APIError(400, "messages: this model has no chat template; use /v1/completions",
                       param="messages")
    messages = [{"role": "system" if m.role == "developer" else m.role,
                 "content": _utf8(m.text(), f"messages[{i}].content", "messages")}
                for i, m in enumerate(req.messages)]
    try:
        # the template writes the special tokens (BOS included); those in messages stay text
        return tokenizer.chat_ids(messages, add_generation_prompt=True)
    except (LmplugError, jinja2.TemplateError) as exc:
        raise APIError(400, f"messages: the chat template rejected them: {exc}", param="messages") from None


def completion_prompt_ids(tokenizer: Tokenizer | None, req: CompletionRequest,
                          vocab_size: int) -> list[list[int]]:
    """One list of token ids per prompt; text is encoded as ``LLM.generate`` encodes it."""
    prompt = req.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts: list = [prompt]
    else:
        prompts = list(prompt)
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


def check_request_size(req: ChatCompletionRequest | CompletionRequest, num_prompts: int) -> None:
    """One request queues at most ``MAX_REQUEST_SEQS`` sequences (``n`` x prompts)."""
    if req.n * num_prompts > MAX_REQUEST_SEQS:
        raise APIError(400, f"n: {req.n} samples x {num_prompts} prompts = {req.n * num_prompts} sequences, "
                            f"more than {MAX_REQUEST_SEQS} per request; lower n or send fewer prompts",
                       param="n")


# -- sampling --------------------------------------------------------------------------------------


def sampling_params(req: ChatCompletionRequest | CompletionRequest, prompts: list[list[int]],
                    max_model_len: int, default_max_tokens: int | None) -> SamplingParams:
    """Check the lengths against the context and build the params (bad values -> 400)."""
    bad = req.unsupported()
    if bad:
        raise APIError(400, f"{bad[0]}: not supported by lmplug (leave it unset or at its default)",
                       param=bad[0], code="unsupported_parameter")
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
            logprobs=req.num_logprobs, skip_special_tokens=req.skip_special_tokens)
    except LmplugError as exc:
        # "SamplingParams.top_k=-3 is invalid: ..." -> "top_k=-3 is invalid: ..."
        message = str(exc).removeprefix("SamplingParams.")
        raise APIError(400, message, param=message.split("=", 1)[0]) from None


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


def completion_logprobs(token_ids: list[int], rows: list[dict[int, Logprob]], k: int, names: TokenText,
                        text_offset: int) -> CompletionLogprobs:
    """``text_offset`` is where the first of these tokens starts in the choice's text."""
    out = CompletionLogprobs()
    for tid, row in zip(token_ids, rows):
        s = names.text(tid)
        out.tokens.append(s)
        out.token_logprobs.append(row[tid].logprob)
        out.top_logprobs.append({names.text(t): lp.logprob for t, lp in _top(row, k)})
        out.text_offset.append(text_offset)
        text_offset += len(s)
    return out
