"""LoRA adapters over HTTP (vLLM's surface): ``model: NAME`` picks an adapter, ``/v1/models``
lists them beside the base model, ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
(behind the API key, as every /v1 route) load and forget them at run time.

Loading runs on the engine thread between steps (``AsyncEngine.call``): reading and checking the
files is the engine's work, and a bad adapter is a 400 naming it and the field while the
engine goes on serving the others.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from lmplug.engine.adapters import UnknownAdapter
from lmplug.errors import LmplugError
from lmplug.interfaces.adapter import LoRARequest
from lmplug.serve.async_engine import AsyncEngine
from lmplug.serve.errors import APIError


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's clients may send it; the name decides


class Models:
    """The names a request's ``model`` may give: the base model's and each loaded adapter's."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.core = engine.engine
        self.model_name = model_name

    def resolve(self, requested: str | None) -> LoRARequest | None:
        """The adapter ``requested`` names (None: the base model); unknown: 404 in OpenAI's shape."""
        if requested is None or requested == self.model_name:
            return None
        for lora in self.core.list_loras():
            if lora.lora_name == requested:
                return lora
        names = ", ".join(repr(n) for n in [self.model_name] + [lr.lora_name for lr in self.core.list_loras()])
        raise APIError(404, f"model: {requested!r} is not served here (available: {names})",
                       param="model", code="model_not_found")


def lora_router(engine: AsyncEngine, read: Callable[[Request, type[BaseModel]], Awaitable[Any]]) -> APIRouter:
    """The two routes (mounted under /v1 with the API key)."""
    router = APIRouter()
    core = engine.engine

    def serving() -> None:
        if core.adapters is None:
            raise APIError(400, "this server serves no LoRA adapters: start it with --enable-lora or "
                                "--lora-modules NAME=PATH", param="lora_name")

    @router.post("/load_lora_adapter")
    async def load(request: Request) -> PlainTextResponse:
        req = await read(request, LoadLoRARequest)
        serving()

        def add() -> None:
            known = core.list_loras()
            lora = LoRARequest(req.lora_name, max((lr.lora_int_id for lr in known), default=0) + 1, req.lora_path)
            if any(lr.lora_name == req.lora_name for lr in known):
                raise APIError(400, f"LoRA adapter {req.lora_name!r} is already loaded", param="lora_name")
            core.add_lora(lora)

        try:
            await engine.call(add)
        except LmplugError as exc:
            raise APIError(400, str(exc), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @router.post("/unload_lora_adapter")
    async def unload(request: Request) -> PlainTextResponse:
        req = await read(request, UnloadLoRARequest)
        serving()
        try:
            await engine.call(lambda: core.remove_lora(req.lora_name))
        except UnknownAdapter as exc:
            raise APIError(404, str(exc), param="lora_name", code="model_not_found") from None
        except LmplugError as exc:
            raise APIError(400, str(exc), param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    return router
