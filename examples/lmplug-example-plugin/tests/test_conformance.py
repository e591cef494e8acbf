"""The whole lmplug conformance suite for the ``chunked`` backend: this is all an author writes."""

from lmplug.testing import AttentionConformance


class TestChunkedAttention(AttentionConformance):
    backend = "chunked"  # found through this package's entry point
    options = {"chunk_size": 16}  # small chunks, so every batch spec crosses chunk boundaries
