"""``POST /v1/embeddings`` in OpenAI's shape, over the engine's pooling requests.

``input`` is a string, a list of strings, a list of token ids or a list of lists of token ids;
each becomes one embedding request (``lmplug.outputs.pooling``), batched in the engine with
whatever else runs. ``encoding_format`` ``float`` (a list) or ``base64`` (little-endian float32
bytes, what the ``openai`` client asks for and decodes by default). ``dimensions``: Matryoshka
truncation where the checkpoint declares it (a 400 naming ``dimensions`` otherwise). The pooling
type and normalization: the server config's ``pooler`` section, else the checkpoint's
sentence-transformers modules (``lmplug.loading.pooling_config``).
"""

from __future__ import annotations

import base64
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from lmplug.engine.engine import check_pooling
from lmplug.errors import ConfigError
from lmplug.outputs.pooling import PoolingParams
from lmplug.serve.async_engine import AsyncEngine
from lmplug.serve.errors import APIError

Reader = Callable[[Request, type[BaseModel]], Awaitable[Any]]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


def embeddings_router(engine: AsyncEngine, read: Reader, check_model: Callable[[str | None], None],
                      model_name: str, dependencies: list | None = None) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=dependencies or [])
    core = engine.engine

    @router.post("/embeddings")
    async def embeddings(request: Request) -> dict:
        req = await read(request, EmbeddingRequest)
        check_model(req.model)
        pooling = _pooling(core, req)
        prompts = await run_in_threadpool(input_ids, core, req.input)
        vectors = await _run(engine, prompts, pooling)
        data = [{"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
                for i, v in enumerate(vectors)]
        used = sum(map(len, prompts))
        return {"object": "list", "data": data, "model": model_name,
                "usage": {"prompt_tokens": used, "total_tokens": used}}

    return router


def _pooling(core: Any, req: EmbeddingRequest) -> PoolingParams:
    """The request's pooling, or a 400 naming the model (it cannot pool) or ``dimensions``."""
    try:
        return check_pooling(core, PoolingParams(dimensions=req.dimensions))
    except ConfigError as exc:
        param = "dimensions" if str(exc).startswith("dimensions") else "model"
        raise APIError(400, str(exc), param=param, code="invalid_value") from None


def input_ids(core: Any, value: str | list) -> list[list[int]]:
    """``input`` as token id lists, each checked against the vocabulary and ``max_model_len``."""
    if isinstance(value, str):
        items: list = [value]
    elif value and isinstance(value[0], int):
        items = [value]
    else:
        items = list(value)
    if not items:
        raise APIError(400, "input: an empty list; give at least one string or list of token ids", param="input")
    out = []
    for i, item in enumerate(items):
        where = "input" if len(items) == 1 and not isinstance(value, list) else f"input[{i}]"
        ids = _encode_text(core, item, where) if isinstance(item, str) else list(item)
        _check(ids, where, core.max_model_len, core.model_config.vocab_size)
        out.append(ids)
    return out


def _encode_text(core: Any, text: str, where: str) -> list[int]:
    if core.tokenizer is None:
        raise APIError(400, f"{where}: this model has no tokenizer; send token ids", param="input")
    return core.tokenizer.encode(text)


def _check(ids: list[int], where: str, max_len: int, vocab: int) -> None:
    if not ids:
        raise APIError(400, f"{where}: empty; an embedding needs at least one token", param="input")
    if len(ids) > max_len:
        raise APIError(400, f"{where}: {len(ids)} tokens, more than this model's max_model_len={max_len}",
                       param="input", code="context_length_exceeded")
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"{where}: {bad} is not a token id of this model (0 to {vocab - 1})", param="input")


async def _run(engine: AsyncEngine, prompts: list[list[int]], pooling: PoolingParams) -> list[list[float]]:
    vectors: list[list[float] | None] = [None] * len(prompts)
    group = engine.embed(prompts, pooling, f"embd-{time.monotonic_ns():x}")
    async with group:  # leaving early (client gone, error) aborts what still runs
        await group.admitted()
        async for update in group:
            vectors[update.prompt_index] = update.embedding
    return [v or [] for v in vectors]


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector
