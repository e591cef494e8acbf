"""The demo model dequantised to a dense fp32 HF checkpoint by transformers' own GGUF reader (a
helper, not a test file): lmplug and transformers then run the very same weights."""

from __future__ import annotations

from pathlib import Path

import torch


def dense_demo(demo_gguf: Path, folder: Path):
    """Save the dense checkpoint in ``folder``; return the transformers model (fp32, eval)."""
    from transformers import AutoModelForCausalLM

    read = AutoModelForCausalLM.from_pretrained(str(demo_gguf.parent), gguf_file=demo_gguf.name,
                                                dtype=torch.float32)
    config = read.config
    config.quantization_config = None  # the weights are dense now; a "gguf" model will not save
    del config.quantization_config
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf.load_state_dict(read.state_dict())
    hf.eval().save_pretrained(folder)
    return hf
