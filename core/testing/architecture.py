"""Conformance for architecture backends (the ``model`` family): parity with transformers.

Subclass, name the architecture and give tiny HF configs (``config.json`` dicts)::

    class TestMine(ArchitectureConformance):
        backend = "mine"
        configs = {"mine_small": {"model_type": "mine", "hidden_size": 64, ...}}

Each config becomes a random fp32 model built by transformers (norm weights and biases
randomised too: HF's ones / zeros would hide a loader that drops them), saved as a safetensors
folder. lmplug must match transformers on that folder: prompt logprobs within 1e-4, 32 greedy
tokens equal; batched equal to alone; a paged KV cache equal to the contiguous one; chunked
prefill at small token budgets; preemption in a tiny block pool; tensor parallelism (two ranks)
where the architecture declares it and the heads divide.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

PROMPT_LEN = 24
NEW_TOKENS = 32
ATOL = 1e-4


def build_tiny(config: dict[str, Any], path: Path, seed: int = 0) -> Any:
    """A random transformers model of ``config`` saved under ``path``; returns it (eager, eval)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(config)
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith((".bias", "sinks")):
                p.copy_(0.2 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(path)
    return model


TINY: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}


def kit_configs(cls: type, paths: list[str]) -> tuple[dict[str, dict] | None, str | None]:
    """The configs ``--check model:NAME`` runs: each ``--hf-config`` file, or a tiny config of
    the architecture's first model type (a fallback: llama). (configs, None) or (None, problem)."""
    if not paths:
        model_type = cls.model_types[0] if cls.model_types else ("llama" if cls.fallback else None)
        if model_type is None:
            return None, f"architecture {cls.name!r} declares no model_types: give --hf-config PATH"
        return {model_type: {**TINY, "model_type": model_type}}, None
    configs = {}
    for path in paths:
        try:
            config = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            return None, f"--hf-config {path}: cannot read a JSON config ({exc})"
        if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
            return None, f"--hf-config {path}: expected a config.json object with a 'model_type'"
        configs[Path(path).stem if len(paths) > 1 else config["model_type"]] = config
    return configs, None


def prompt(length: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


@torch.no_grad()
def hf_prompt_logprobs(hf: Any, ids: list[int]) -> torch.Tensor:
    lp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return torch.tensor([lp[i - 1, ids[i]].item() for i in range(1, len(ids))], dtype=torch.float64)


@torch.no_grad()
def hf_greedy(hf: Any, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):  # plain argmax over the full prefix: no generation config, no EOS, no cache
        out.append(int(hf(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def our_prompt_logprobs(out: Any, ids: list[int]) -> torch.Tensor:
    return torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))],
                        dtype=torch.float64)


class ArchitectureConformance:
    backend: ClassVar[str]  # the architecture's name (``model_impl``)
    configs: ClassVar[dict[str, dict[str, Any]]] = {}
    max_model_len: ClassVar[int] = 128

    @pytest.fixture(scope="class")
    @classmethod
    def tiny(cls):
        """(name -> (folder, hf model)) built once per class."""
        root = Path(tempfile.mkdtemp(prefix="lmplug-arch-"))
        built = {}
        for name, config in cls.configs.items():
            built[name] = (root / name, build_tiny(config, root / name))
        return built

    def llm(self, path: Path, **overrides: Any) -> Any:
        from lmplug import LLM

        return LLM(str(path), dtype="float32", device="cpu", max_model_len=self.max_model_len,
                   **self.llm_options(), **overrides)

    def llm_options(self) -> dict[str, Any]:
        """Config keys that select this architecture (``model_impl``)."""
        return {"model_impl": self.backend}

    def _each(self, tiny):
        for name, (path, hf) in tiny.items():
            yield name, path, hf, hf.config.vocab_size

    def test_prompt_logprobs_and_greedy_match_transformers(self, tiny):
        from lmplug import SamplingParams

        for name, path, hf, vocab in self._each(tiny):
            ids = prompt(PROMPT_LEN, 1, vocab)
            for kv in ({"backend": "contiguous"}, {"backend": "paged", "block_size": 4}):
                out = self.llm(path, kvcache=kv).generate([ids], SamplingParams(
                    prompt_logprobs=0, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))[0]
                torch.testing.assert_close(our_prompt_logprobs(out, ids), hf_prompt_logprobs(hf, ids),
                                           atol=ATOL, rtol=0, msg=lambda m, n=name, k=kv: f"{n} {k}: {m}")
                assert out.token_ids == hf_greedy(hf, ids, NEW_TOKENS), f"{name} {kv}: greedy tokens differ"

    def test_batched_equals_alone_with_chunked_prefill(self, tiny):
        from lmplug import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for name, path, _, vocab in self._each(tiny):
            prompts = [prompt(n, 10 + n, vocab) for n in (5, 17, 30)]
            llm = self.llm(path, kvcache={"backend": "paged", "block_size": 4},
                           scheduler={"max_num_batched_tokens": 7})
            together = [o.token_ids for o in llm.generate(prompts, params)]
            alone = [self.llm(path).generate([p], params)[0].token_ids for p in prompts]
            assert together == alone, f"{name}: batched, chunked at 7 tokens, differs from alone"

    def test_preemption_in_a_tiny_pool(self, tiny):
        from lmplug import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        for name, path, _, vocab in self._each(tiny):
            prompts = [prompt(20, 40 + i, vocab) for i in range(4)]
            small = self.llm(path, kvcache={"backend": "paged", "block_size": 4, "num_blocks": 24})
            got = [o.token_ids for o in small.generate(prompts, params)]
            alone = [self.llm(path).generate([p], params)[0].token_ids for p in prompts]
            assert got == alone, f"{name}: outputs differ when sequences are preempted"

    def test_tensor_parallel_where_the_heads_divide(self, tiny):
        """Two ranks (gloo, worker processes that find the architecture through its entry point):
        greedy tokens equal transformers'. Skipped, with the reason, where the architecture does
        not declare ``tensor_parallel`` or no config's heads divide by two."""
        from lmplug import SamplingParams
        from lmplug.interfaces.architecture import TENSOR_PARALLEL
        from lmplug.plugins import get_registry

        info = get_registry().backends("model").get(self.backend)
        if info is not None and TENSOR_PARALLEL not in info.cls.capabilities.features:
            pytest.skip(f"architecture {self.backend!r} does not declare {TENSOR_PARALLEL!r}")
        ran = []
        for name, path, hf, vocab in self._each(tiny):
            cfg = hf.config
            heads = cfg.num_attention_heads
            kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
            if heads % 2 or kv_heads % 2 or cfg.intermediate_size % 2:
                continue
            ids = prompt(PROMPT_LEN, 7, vocab)
            llm = self.llm(path, parallel={"tensor_parallel_size": 2})
            try:
                out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
            finally:
                llm.close()  # one tensor-parallel engine per process at a time
            assert out.token_ids == hf_greedy(hf, ids, 16), f"{name}: greedy tokens differ under TP=2"
            ran.append(name)
        if not ran:
            pytest.skip("no config's attention heads, KV heads and intermediate size divide by two")
