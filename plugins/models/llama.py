"""The Llama family: Llama 2/3, Mistral, Qwen2, Qwen3 — the kit's standard decoder as it is
(their differences are flags of ``ModelConfig``: biases, q/k norms, tied embeddings, RoPE scaling)."""

from __future__ import annotations

from lmplug.kit.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama 2/3, Mistral, Qwen2, Qwen3."""
