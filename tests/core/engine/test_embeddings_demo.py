"""The demo model (SmolLM2-135M), dequantised from its GGUF to a dense fp32 HF checkpoint by
transformers' own GGUF reader: lmplug's last-token embeddings of that checkpoint equal transformers'
last hidden state (the final norm's output) at the last prompt token, normalized."""

from __future__ import annotations

import pytest
import torch
from support.demo_dense import dense_demo
from support.hf_models import one_torch_thread  # noqa: F401

from lmplug import LLM, PoolingParams

PROMPTS = [[1, 504, 3458, 282, 4114, 314, 253, 2378, 30, 378, 2378, 314], [1, 28, 1032], [9], list(range(100, 190))]


@pytest.mark.slow
def test_demo_model_last_token_embeddings_match_transformers(demo_gguf, tmp_path):
    hf = dense_demo(demo_gguf, tmp_path / "dense")
    llm = LLM(str(tmp_path / "dense"), dtype="float32", device="cpu", max_model_len=256)
    outs = llm.embed(PROMPTS, PoolingParams(pooling_type="last", normalize=True))
    for ids, out in zip(PROMPTS, outs):
        with torch.no_grad():
            last = hf.model(torch.tensor([ids])).last_hidden_state[0, -1]
        want = torch.nn.functional.normalize(last, dim=0)
        got = torch.tensor(out.outputs.embedding)
        assert got.shape == (hf.config.hidden_size,)
        assert torch.nn.functional.cosine_similarity(got, want, dim=0).item() >= 0.99999
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
