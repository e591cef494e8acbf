"""The ``flash`` attention backend: FlashAttention-2-style Triton kernels (varlen prefill, split-K decode)."""
