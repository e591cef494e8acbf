"""Output processing: everything between a step's chosen tokens and what callers receive.

The request table (``requests.py``: a request's sequences, detokenizers), stop
checks (``stopping.py``), embeddings' pooling (``pooling.py``), logprobs (``logprobs.py``), streaming deltas and the result types
(``types.py``: ``RequestOutput``, ``CompletionOutput``, ``RequestMetrics``). It never imports
the engine: the engine hands it sequences, tokens and logits.
"""

from lmplug.outputs.pooling import EmbeddingOutput, EmbeddingRequestOutput, PoolingParams
from lmplug.outputs.requests import Request, RequestTable
from lmplug.outputs.stopping import check_stop
from lmplug.outputs.types import CompletionOutput, RequestMetrics, RequestOutput

__all__ = ["CompletionOutput", "EmbeddingOutput", "EmbeddingRequestOutput", "PoolingParams", "Request", "RequestMetrics", "RequestOutput", "RequestTable", "check_stop"]
