"""The demo model (SmolLM2-135M, Q4_1 GGUF) with a random LoRA adapter over its packed blocks
equals the same adapter over the dequantized weights (``quant: {dequantize_at_load: true}``),
within the packed path's tolerance: 1e-3 with the torch kernel (dequantize per call), and with
the native kernel (8-bit activations, as llama.cpp) no further from the dequantized path than the
packed base model is from the dequantized base."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from support.hf_models import one_torch_thread  # noqa: F401

from lmplug import LLM, LoRARequest, SamplingParams

PROMPT = "The river had been rising for three days before anyone in the village thought to move the grain."
LORA = {"max_loras": 2, "max_lora_rank": 8}


def write_adapter(folder, targets: dict[str, tuple[int, int]], rank: int = 8, seed: int = 0) -> None:
    """A random adapter in PEFT's saved format (keys ``base_model.model.<module>.lora_A.weight``)."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (d_in, d_out) in targets.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) / d_in ** 0.5
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * 0.05
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none", "use_dora": False,
        "target_modules": sorted({m.rpartition(".")[2] for m in targets})}))


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
