"""lmplug_compressor: prompt-compression methods (truncate, selective, llmlingua)."""

from __future__ import annotations

from lmplug_compressor.llmlingua import LLMLingua
from lmplug_compressor.selective import Selective
from lmplug_compressor.truncate import Truncate

from lmplug.api import hookimpl

LMPLUG_API_VERSION = 3


@hookimpl
def lmplug_register_compressors() -> list[type]:
    return [Truncate, Selective, LLMLingua]
