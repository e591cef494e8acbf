"""Embeddings (``LLM.embed``): pooled final hidden states against transformers' ``AutoModel``."""

from __future__ import annotations

import pytest
import torch
from support.hf_models import get_model, one_torch_thread, prompt_ids  # noqa: F401  (autouse fixture)

from lmplug import ConfigError, PoolingParams, SamplingParams

PROMPTS = [prompt_ids(n, seed=n) for n in (1, 5, 17, 40)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return get_model("llama", tmp_path_factory.mktemp("emb"))


@pytest.fixture(scope="module")
def hf_base(tiny):
    from transformers import AutoModel

    return AutoModel.from_pretrained(tiny.path, dtype=torch.float32, attn_implementation="eager").eval()


def reference(hf_base, ids: list[int], kind: str, normalize: bool) -> torch.Tensor:
    """The pooling vLLM's LAST / MEAN / CLS poolers apply to transformers' last hidden state."""
    with torch.no_grad():
        hidden = hf_base(torch.tensor([ids])).last_hidden_state[0]
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[kind]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
@pytest.mark.parametrize("normalize", [True, False])
def test_pooled_vectors_match_transformers(tiny, hf_base, kind, normalize):
    outs = tiny.llm().embed(PROMPTS, PoolingParams(pooling_type=kind, normalize=normalize))
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    for ids, out in zip(PROMPTS, outs):
        got = torch.tensor(out.outputs.embedding)
        want = reference(hf_base, ids, kind, normalize)
        assert got.shape == (tiny.config["hidden_size"],)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_batched_equals_alone(tiny):
    llm = tiny.llm()
    params = PoolingParams(pooling_type="mean")
    batched = [o.outputs.embedding for o in llm.embed(PROMPTS, params)]
    alone = [llm.embed([p], params)[0].outputs.embedding for p in PROMPTS]
    for b, a in zip(batched, alone):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), atol=1e-5, rtol=1e-5)


def test_chunked_prefill_pools_every_chunk(tiny, hf_base):
    """A prompt prefilled over several steps (chunks of 8) pools the same vector."""
    llm = tiny.llm(scheduler={"backend": "continuous", "max_num_batched_tokens": 8})
    out = llm.embed([PROMPTS[-1]], PoolingParams(pooling_type="mean"))[0]
    want = reference(hf_base, PROMPTS[-1], "mean", True)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-4, rtol=1e-4)


def test_embeddings_beside_generation_never_run_the_lm_head(tiny, monkeypatch):
    """Embedding rows share steps with generations; the LM head sees only the generations' rows."""
    llm = tiny.llm()
    engine, head_rows = llm.engine, []
    model = engine.runner.model
    real = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda h: head_rows.append(h.shape[0]) or real(h))
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], greedy)[0].token_ids
    head_rows.clear()
    engine.add_request("gen", PROMPTS[1], greedy)
    engine.add_request("emb", PROMPTS[3], pooling=PoolingParams())
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    assert outs["gen"].token_ids == alone
    assert len(outs["emb"].outputs.embedding) == tiny.config["hidden_size"]
    assert head_rows == [1, 1, 1]  # one row per generated token: none for the 40-token embedding


def test_bad_input_is_named(tiny, monkeypatch):
    llm = tiny.llm()
    with pytest.raises(ConfigError, match="prompts is empty"):
        llm.embed([])
    with pytest.raises(ConfigError, match="does not fit max_model_len=256"):
        llm.embed([[5] * 257])
    assert len(llm.embed([[5] * 256])[0].outputs.embedding) == 64  # the whole context fits an embedding
    with pytest.raises(ConfigError, match="pooling_type"):
        PoolingParams(pooling_type="max")
    with pytest.raises(ConfigError, match="dimensions"):
        llm.embed(["x"] if llm.tokenizer else [[5]], PoolingParams(dimensions=8))
    monkeypatch.setattr(llm.engine.runner.model, "final_hidden_states", False)
    with pytest.raises(ConfigError, match="cannot pool.*native architectures"):
        llm.embed([[5, 6]])


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_a_prefix_cache_hit_pools_the_same_vector(tiny, hf_base, kind):
    """With the prefix cache, a repeated prompt hits cached blocks: mean and CLS still pool every
    token (they compute the whole prompt), last pools its last token."""
    llm = tiny.llm(kvcache={"backend": "paged", "prefix_caching": True, "block_size": 8})
    params = PoolingParams(pooling_type=kind)
    llm.generate([PROMPTS[-1]], SamplingParams(max_tokens=1))  # fills the cache with the prompt's blocks
    out = llm.embed([PROMPTS[-1]], params)[0]
    want = reference(hf_base, PROMPTS[-1], kind, True)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-4, rtol=1e-4)
