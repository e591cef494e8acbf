"""Prompt compression in the core: the scorer, the prompt's segments, the fallback, the report.

``PromptCompressor`` is built once per engine. For each request it settles the method and its
options (the request's ``CompressionParams`` over the config's ``compression:`` section), splits
the prompt into ``Segment`` s, runs the method and reports what happened (``CompressionReport``).

What is protected (never handed to a method as compressible): the final question (a text
prompt's last paragraph; in a chat, the last paragraph of the last user message), every system or
developer message, chat-role markup (only message contents are compressed; the template is applied
afterwards), and every occurrence of each ``protect`` string (one that does not occur is a
``ConfigError`` naming ``compression.protect``).

A method that raises, or returns protected segments changed, falls back to the full prompt with a
logged warning and ``CompressionReport.fallback`` set: a request is never lost to compression. A
scorer model that cannot load is a ``ConfigError`` naming ``compression.scorer`` instead.

The scorer (``EngineScorer``, ``scorer.py``) is a separate ``LLMEngine`` (float32, CPU, a short
context), built on first use and shared by every request of the engine behind one lock, so
``compress_*`` may run in worker threads (the server calls them with ``asyncio.to_thread``) while
the main engine steps. The prompt's segments are cut in ``segments.py``; ``PromptCompressor``
(``prompt_compressor.py``) settles, runs and reports.
"""

from lmplug.compression.prompt_compressor import PROTECTED_ROLES, SCORER_KEYS, PromptCompressor
from lmplug.compression.scorer import CANCEL, CompressionCancelled, EngineScorer, check_cancelled
from lmplug.compression.segments import MAX_COMPRESS_CHARS, final_paragraph, occurrences, split_text

__all__ = ["CANCEL", "MAX_COMPRESS_CHARS", "PROTECTED_ROLES", "SCORER_KEYS", "CompressionCancelled",
           "EngineScorer", "PromptCompressor", "check_cancelled", "final_paragraph", "occurrences",
           "split_text"]
