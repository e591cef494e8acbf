"""The demo model (SmolLM2-135M, Q4_1 GGUF) with a random LoRA adapter over its packed blocks
equals the same adapter over the dequantized weights (``quant: {dequantize_at_load: true}``),
within the packed path's tolerance: 1e-3 with the torch kernel (dequantize per call), and with
the native kernel (8-bit activations, as llama.cpp) no further from the dequantized path than the
packed base model is from the dequantized base."""

from __future__ import annotations

import pytest
import torch
from support.hf_models import one_torch_thread  # noqa: F401
from support.lora_adapters import write_adapter

from lmplug import LLM, LoRARequest, SamplingParams

PROMPT = "The river had been rising for three days before anyone in the village thought to move the grain."
LORA = {"max_loras": 2, "max_lora_rank": 8}


def prompt_logprobs(llm, ids, lora) -> torch.Tensor:
    out = llm.generate([ids], SamplingParams(prompt_logprobs=0, max_tokens=1), lora=lora)[0]
    return torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_adapter_over_packed_gguf_equals_dequantized(demo_gguf, tmp_path, kernel):
    dense = LLM(str(demo_gguf), dtype="float32", max_model_len=128, lora=LORA,
                quant={"method": "gguf", "dequantize_at_load": True})
    packed = LLM(str(demo_gguf), dtype="float32", max_model_len=128, lora=LORA,
                 quant={"method": "gguf", "kernel": kernel})
    try:
        write_adapter(tmp_path / "a", dense.engine.adapters.targets)
        lora = LoRARequest("a", 1, str(tmp_path / "a"))
        ids = dense.tokenizer.encode(PROMPT, add_special_tokens=False)
        want, base = prompt_logprobs(dense, ids, lora), prompt_logprobs(dense, ids, None)
        got = prompt_logprobs(packed, ids, lora)
        assert (want - base).abs().mean() > 0.05  # the adapter moves the model
        if kernel == "torch":
            torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
        else:  # 8-bit activations: the adapter adds no error beyond the packed path's own
            own = (prompt_logprobs(packed, ids, None) - base).abs().mean()
            assert (got - want).abs().mean() <= 1.5 * own + 0.01, ((got - want).abs().mean(), own)
    finally:
        dense.close()
        packed.close()
