"""The denoising select stage against transformers' ``DiffusionGemmaForBlockDiffusion.generate``
(tiny random weights): with the same seed, token for token equal (the stage draws from the
sequence's generator in transformers' order: the canvas, then per step the draw and the
renoising), alone and batched, contiguous and paged, across several canvases, with EOS inside a
canvas and ``max_tokens`` inside one; one streamed delta per committed canvas; bad input."""

from __future__ import annotations

import pytest
import torch
from support.diffusion_gemma import CANVAS, build_diffusion_gemma

pytestmark = [pytest.mark.hf]

STEPS = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("diffusion-gemma-generate")
    return path, build_diffusion_gemma(path)


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(3, 96, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def hf_generate(hf, prompt: list[int], seed: int, max_new_tokens: int, steps: int = STEPS, eos: int | None = None):
    torch.manual_seed(seed)
    extra = {} if eos is None else {"eos_token_id": eos}
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, max_denoising_steps=steps, **extra)
    return out.sequences[0, len(prompt):].tolist()


def llm_of(path, **overrides):
    from lmplug import LLM

    return LLM(str(path), dtype="float32", device="cpu", max_model_len=96, **overrides)


def params(seed: int, max_tokens: int, steps: int = STEPS, **extra):
    from lmplug import SamplingParams

    return SamplingParams(max_tokens=max_tokens, seed=seed, denoising={"max_denoising_steps": steps}, **extra)


@pytest.mark.slow
@pytest.mark.parametrize("kvcache, attention", [
    ({"backend": "contiguous"}, {"backend": "sdpa"}),
    ({"backend": "paged", "block_size": 4}, {"backend": "paged"}),
])
def test_generate_alone_equals_transformers(tiny, kvcache, attention):
    """Three canvases after a prompt longer than the sliding window, and the default schedule of
    48 steps for one canvas (the early stop decides)."""
    path, hf = tiny
    llm = llm_of(path, kvcache=kvcache, attention=attention)
    prompt = prompt_of(13, 5)
    assert llm.generate([prompt], params(7, 12))[0].token_ids == hf_generate(hf, prompt, 7, 12)
    assert llm.generate([prompt], params(11, 4, steps=48))[0].token_ids == hf_generate(hf, prompt, 11, 4, steps=48)


@pytest.mark.slow
def test_batched_with_chunked_prefill_equals_transformers_alone(tiny):
    """Three requests of their own seeds in one batch, prompts chunked at 8 tokens a step: each
    equals transformers' generate for its seed alone; max_tokens inside a canvas cuts it."""
    path, hf = tiny
    llm = llm_of(path, kvcache={"backend": "paged", "block_size": 4}, scheduler={"max_num_batched_tokens": 8})
    prompts = [prompt_of(n, n) for n in (5, 13, 20)]
    outs = llm.generate(prompts, [params(100 + i, 10) for i in range(3)])
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.token_ids == hf_generate(hf, prompt, 100 + i, 12)[:10], f"request {i}"


@pytest.mark.slow
def test_eos_inside_a_canvas_ends_the_request(tiny):
    """EOS (here a stop token id) in the second canvas: the output ends there, as transformers'
    (which pads the rest of that canvas)."""
    path, hf = tiny
    prompt = prompt_of(13, 5)
    free = hf_generate(hf, prompt, 7, 12)
    eos = free[CANVAS + 1]  # the second token of the second canvas
    first = free.index(eos)
    want = hf_generate(hf, prompt, 7, 12, eos=eos)[:first + 1]
    out = llm_of(path).generate([prompt], params(7, 12, stop_token_ids=[eos]))[0]
    assert out.token_ids == want and out.finish_reason == "stop"


@pytest.mark.slow
def test_streaming_gives_one_delta_per_committed_canvas(tiny):
    path, _ = tiny
    llm = llm_of(path)
    deltas = [out.delta_token_ids for out in llm.stream(prompt_of(9, 2), params(3, 10))]
    sizes = [len(d) for d in deltas if d]
    assert sizes == [CANVAS, CANVAS, 2]


def test_bad_requests_are_refused_naming_the_option(tiny, tmp_path):
    from lmplug import SamplingParams
    from lmplug.errors import ConfigError
    from lmplug.testing.architecture import TINY, build_tiny

    path, _ = tiny
    llm = llm_of(path)
    prompt = prompt_of(5, 1)
    with pytest.raises(ConfigError, match="top_p"):
        llm.generate([prompt], SamplingParams(top_p=0.5))
    with pytest.raises(ConfigError, match="logprobs"):
        llm.generate([prompt], SamplingParams(logprobs=2))
    with pytest.raises(ConfigError, match="canvas_length"):
        llm.generate([prompt], SamplingParams(denoising={"canvas_length": CANVAS + 1}))
    for bad, name in (({"max_denoising_steps": 0}, "max_denoising_steps"), ({"t_max": 0.1}, "t_max"),
                      ({"canvas_length": 0}, "canvas_length"), ({"steps": 4}, "steps")):
        with pytest.raises(ConfigError, match=name):
            SamplingParams(denoising=bad)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        llm_of(path, scheduler={"max_num_batched_tokens": CANVAS - 1}).generate([prompt], SamplingParams())
    build_tiny({**TINY, "model_type": "llama"}, tmp_path)
    from lmplug import LLM

    plain = LLM(str(tmp_path), dtype="float32", device="cpu", max_model_len=64)
    with pytest.raises(ConfigError, match="denoising.*not a block-diffusion model"):
        plain.generate([prompt], SamplingParams(denoising={"max_denoising_steps": 4}))


@pytest.mark.slow
def test_preemption_in_a_tiny_pool_keeps_the_tokens(tiny):
    """Four requests in a pool of 12 blocks of 4 tokens: sequences are preempted (recomputed)
    between canvases and mid-denoising; each output equals its run alone."""
    path, _ = tiny
    prompts = [prompt_of(14, 40 + i) for i in range(4)]
    small = llm_of(path, kvcache={"backend": "paged", "block_size": 4, "num_blocks": 12})
    got = [o.token_ids for o in small.generate(prompts, [params(i, 12) for i in range(4)])]
    assert small.engine.scheduler.num_preemptions > 0
    alone = llm_of(path)
    assert got == [alone.generate([p], params(i, 12))[0].token_ids for i, p in enumerate(prompts)]


@pytest.mark.slow
def test_a_stop_string_cuts_the_committed_text(tiny, tmp_path):
    """With a tokenizer (the tiny vocabulary's: ids 3-95 are single characters), a stop string met
    inside a committed canvas ends the request there: the text is transformers' continuation for the
    seed cut before the string's first occurrence, finish_reason "stop", and the token ids stay a
    prefix of that continuation."""
    import shutil

    from support.hf_models import write_tokenizer
    from transformers import PreTrainedTokenizerFast

    path, hf = tiny
    folder = tmp_path / "with-tokenizer"
    shutil.copytree(path, folder)
    write_tokenizer(folder)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    prompt = prompt_of(13, 5)
    free = hf_generate(hf, prompt, 7, 12)
    text = tok.decode(free, skip_special_tokens=True)  # as lmplug's output text
    # a character of the second canvas (ids 0-2 are the special tokens)
    stop = tok.decode([next(t for t in free[CANVAS:] if t >= 3)])
    cut = text.index(stop)
    out = llm_of(folder).generate([prompt], params(7, 12, stop=[stop]))[0]
    assert 0 < cut < len(text) - 1  # something before it, and something cut
    assert (out.text, out.finish_reason) == (text[:cut], "stop")
    assert out.token_ids == free[:len(out.token_ids)]
