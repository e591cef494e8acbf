"""DiffusionGemma against transformers' ``DiffusionGemmaForBlockDiffusion`` (tiny random weights):
the decoder's logits for a prefix, a canvas and a self-conditioning input, through the engine's
runner (the encoder writes the prefix's K/V; the canvas is a query-masked row), on every KV
layout and attention path; a prefix longer than the sliding window."""

from __future__ import annotations

import pytest
import torch
from support.diffusion_gemma import CANVAS, TEXT, build_diffusion_gemma

pytestmark = [pytest.mark.hf]

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("diffusion-gemma")
    return path, build_diffusion_gemma(path)


@torch.no_grad()
def hf_decoder_logits(hf, prompt: list[int], canvas: list[int], sc: torch.Tensor | None) -> torch.Tensor:
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config.get_text_config(decoder=True))
    hf.model.encoder(input_ids=torch.tensor([prompt]), cache=cache)
    return hf(decoder_input_ids=torch.tensor([canvas]), cache=cache,
              self_conditioning_logits=None if sc is None else sc[None]).logits[0]


def our_decoder_logits(llm, prompt: list[int], canvas: list[int], sc: torch.Tensor | None) -> torch.Tensor:
    """The encoder over ``prompt`` (a plain row), then the decoder over ``canvas`` (a row with an
    all-ones mask and the self-conditioning logits as its inputs)."""
    from lmplug import SamplingParams
    from lmplug.interfaces.scheduler import ScheduledSeq
    from lmplug.interfaces.sequence import Sequence

    parts = llm.engine.parts
    seq = Sequence("r", list(prompt), SamplingParams())
    n, c = len(prompt), len(canvas)
    parts.kv.allocate(seq, n)
    parts.runner.execute([ScheduledSeq(seq, n)])
    seq.advance(n)
    seq.token_ids.extend(canvas)
    parts.kv.allocate(seq, n + c)
    try:
        return parts.runner.execute([ScheduledSeq(seq, c, positions=list(range(n, n + c)),
                                                  mask=torch.ones(c, c, dtype=torch.bool), num_logit_rows=c,
                                                  inputs=sc)]).logits
    finally:
        parts.kv.free(seq)


@pytest.mark.slow
@pytest.mark.parametrize("kvcache, attention", [
    ({"backend": "contiguous"}, {"backend": "sdpa"}),
    ({"backend": "paged", "block_size": 4}, {"backend": "sdpa"}),
    ({"backend": "paged", "block_size": 4}, {"backend": "paged"}),  # the C kernel on CPU
    ({"backend": "paged", "block_size": 4}, {"backend": "paged", "cpu_kernel": "torch"}),
])
def test_decoder_logits_match_transformers(tiny, kvcache, attention):
    """Prefixes of 3 (inside the window of 8) and 13 tokens (past it), with and without
    self-conditioning logits: within 1e-4 of transformers."""
    from lmplug import LLM

    path, hf = tiny
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=64, kvcache=kvcache, attention=attention)
    g = torch.Generator().manual_seed(3)
    for length in (3, 13):
        prompt = torch.randint(3, 96, (length,), generator=g).tolist()
        canvas = torch.randint(0, 96, (CANVAS,), generator=g).tolist()
        for sc in (None, 3 * torch.randn(CANVAS, 96, generator=g)):
            want = hf_decoder_logits(hf, prompt, canvas, sc)
            got = our_decoder_logits(llm, prompt, canvas, sc)
            torch.testing.assert_close(
                got, want, atol=1e-4, rtol=0,
                msg=lambda m, length=length, sc=sc: f"prefix {length}, sc {sc is not None}: {m}")


def test_bad_canvas_length_in_config_is_refused_naming_it():
    from lmplug_models.architectures import DiffusionGemmaArchitecture

    from lmplug.errors import ModelLoadError

    for bad in (0, 10**6, "4"):
        with pytest.raises(ModelLoadError, match="canvas_length"):
            DiffusionGemmaArchitecture(None).parse_config(
                {"model_type": "diffusion_gemma", "text_config": TEXT, "canvas_length": bad}, "config.json")
