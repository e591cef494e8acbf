"""lmplug_compression: prompt-compression methods (truncate, selective, llmlingua)."""

from __future__ import annotations

from lmplug_compression.llmlingua import LLMLingua
from lmplug_compression.selective import Selective
from lmplug_compression.truncate import Truncate

from lmplug.api import hookimpl

LMPLUG_API_VERSION = 3


@hookimpl
def lmplug_register_compression_methods() -> list[type]:
    return [Truncate, Selective, LLMLingua]
