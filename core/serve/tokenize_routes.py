"""``/tokenize``, ``/detokenize`` (also under ``/v1``) and ``/version``, in vLLM's shapes.

``POST /tokenize`` takes ``prompt`` (text, special tokens added unless ``add_special_tokens`` is
false) or ``messages`` (through the chat template, which writes the special tokens itself) and
answers ``{"count", "max_model_len", "tokens", "token_strs"}``; ``POST /detokenize`` takes
``tokens`` and answers ``{"prompt"}``; ``GET /version`` answers ``{"version"}``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, model_validator
from starlette.concurrency import run_in_threadpool

from lmplug import __version__
from lmplug.serve import convert
from lmplug.serve.errors import APIError
from lmplug.serve.protocol import ChatMessage


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' (text) or 'messages' (a chat)")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


Reader = Callable[[Request, type[BaseModel]], Awaitable[Any]]


def tokenizer_router(core: Any, read: Reader, check_model: Callable[[str | None], None],
                     prefix: str = "", dependencies: list | None = None) -> APIRouter:
    """The two routes on ``core``'s tokenizer; ``read`` parses a body into a request model (400 on
    bad input), ``check_model`` refuses a model not served here (404)."""
    router = APIRouter(prefix=prefix, dependencies=dependencies or [])

    @router.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        req = await read(request, TokenizeRequest)
        check_model(req.model)
        tokens = await run_in_threadpool(_tokenize, core.tokenizer, req)
        strs = [core.tokenizer.decode([t], skip_special_tokens=False) for t in tokens] \
            if req.return_token_strs else None
        return {"count": len(tokens), "max_model_len": core.max_model_len, "tokens": tokens, "token_strs": strs}

    @router.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req = await read(request, DetokenizeRequest)
        check_model(req.model)
        _check_ids(req.tokens, core.model_config.vocab_size)
        return {"prompt": core.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    return router


def version_router(dependencies: list | None = None) -> APIRouter:
    router = APIRouter(dependencies=dependencies or [])

    @router.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    return router


def _tokenize(tokenizer: Any, req: TokenizeRequest) -> list[int]:
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer: send token ids", param="prompt")
    if req.prompt is not None:
        return tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    if not req.add_generation_prompt:
        raise APIError(400, "add_generation_prompt: only true is supported (the prompt a chat request gets)",
                       param="add_generation_prompt")
    # the same ids /v1/chat/completions would prefill; the template writes BOS itself
    ids = convert.chat_prompt_ids(tokenizer, SimpleNamespace(messages=req.messages))
    bos = tokenizer.bos_token_id
    if req.add_special_tokens and bos is not None and (not ids or ids[0] != bos):
        ids = [bos, *ids]
    return ids


def _check_ids(tokens: list[int], vocab_size: int) -> None:
    for i, t in enumerate(tokens):
        if not 0 <= t < vocab_size:
            raise APIError(400, f"tokens[{i}]: {t} is not a token id of this model (0 to {vocab_size - 1})",
                           param="tokens")
