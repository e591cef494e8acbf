"""Tiny random HF checkpoints for tests (a helper module, not a test file).

Each model is built by transformers itself (``AutoModelForCausalLM.from_config``
under a fixed seed), given random norm weights and biases (HF initialises them
to ones / zeros, which would let a loader that drops them pass), and saved with
``save_pretrained``. transformers is the independent reference every parity
test compares against.

Builds are cached per process (``get_model``), so two test modules asking for
the same model share one folder and one ``LLM``.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Import into a test module to run it on one intra-op thread. The models here are so
    small that threads only add synchronisation, and on a busy 2-core machine spinning
    workers made these tests ~5x slower."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


VOCAB = 512
SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: the configs' pad/bos/eos

_BASE: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "tie_word_embeddings": False,
}

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # with head_dim 16 and theta 1e4 the wavelengths span 6..2e4, so an original
               # context of 32 puts some frequencies in each of llama3's three bands
               "original_max_position_embeddings": 32}

SPECS: dict[str, dict[str, Any]] = {
    # GQA: 4 query heads over 2 KV heads
    "llama": {"model_type": "llama"},
    "llama3_rope": {"model_type": "llama", "rope_scaling": dict(LLAMA3_ROPE)},
    "llama_tied": {"model_type": "llama", "tie_word_embeddings": True},
    # head_dim 32 != 64 / 4, and a window shorter than prompt + output
    "mistral": {"model_type": "mistral", "head_dim": 32, "sliding_window": 16},
    "qwen2": {"model_type": "qwen2"},  # q/k/v biases
    "qwen3": {"model_type": "qwen3", "head_dim": 16},  # per-head q/k RMSNorm
}


@dataclass
class TinyModel:
    name: str
    path: Path
    hf: Any  # the transformers model, fp32, eval mode
    config: dict
    _llms: dict = field(default_factory=dict, repr=False)
    _hf_dtypes: dict = field(default_factory=dict, repr=False)

    def llm(self, dtype: str = "float32", **overrides: Any):
        """An ``LLM`` over this folder, built once per (dtype, overrides)."""
        from lmplug import LLM

        key = (dtype, json.dumps(overrides, sort_keys=True))
        if key not in self._llms:
            self._llms[key] = LLM(str(self.path), dtype=dtype, device="cpu", max_model_len=256, **overrides)
        return self._llms[key]

    def hf_in(self, dtype: torch.dtype):
        """The reference model loaded from the saved folder in ``dtype``."""
        if dtype == torch.float32:
            return self.hf
        if dtype not in self._hf_dtypes:
            from transformers import AutoModelForCausalLM

            self._hf_dtypes[dtype] = AutoModelForCausalLM.from_pretrained(
                self.path, dtype=dtype, attn_implementation="eager").eval()
        return self._hf_dtypes[dtype]


_CACHE: dict[str, TinyModel] = {}


def make_config(name: str, **extra: Any):
    from transformers import AutoConfig

    spec = {**_BASE, **SPECS[name], **extra}
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **spec)
    cfg._attn_implementation = "eager"
    return cfg


def build_hf_model(config, seed: int = 0):
    """A random transformers model from ``config``; norms and biases randomised too."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif pname.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
    return model.eval()


def get_model(name: str, root: Path, *, tokenizer: bool = False) -> TinyModel:
    """Build (once per process) and save model ``name`` under ``root``."""
    key = f"{name}+tok" if tokenizer else name
    if key in _CACHE:
        return _CACHE[key]
    model = build_hf_model(make_config(name))
    path = root / key
    if path.exists():
        shutil.rmtree(path)
    model.save_pretrained(path)
    if tokenizer:
        write_tokenizer(path)
    tm = TinyModel(key, path, model, json.loads((path / "config.json").read_text()))
    _CACHE[key] = tm
    return tm


# -- a tokenizer matching the tiny vocab --------------------------------------------------------

def vocab_strings() -> list[str]:
    """512 distinct strings: 3 specials, then single characters, then 2- and 3-letter pieces."""
    singles = list("abcdefghijklmnopqrstuvwxyz") + list("ABCDEFGHIJKLMNOPQRSTUVWXYZ") + \
        list("0123456789") + list(" .,;:!?-'\"()")
    pieces, seen = [], set(singles)
    letters = "etaoinshrdlucmfwyp"
    for a in letters:
        for b in letters:
            s = a + b
            if s not in seen:
                pieces.append(s)
                seen.add(s)
    for a in "tsa":
        for b in "heo":
            for c in "nrt":
                s = a + b + c
                if s not in seen:
                    pieces.append(s)
                    seen.add(s)
    for w in ["the", " the", " and", " of", " to", "ing", "tion", " is", " a", " in", "er", "ed"]:
        if w not in seen:
            pieces.append(w)
            seen.add(w)
    vocab = SPECIALS + singles + pieces
    i = 0
    while len(vocab) < VOCAB:  # pad with distinct filler pieces
        s = f"<{i}>"
        i += 1
        if s not in seen:
            vocab.append(s)
            seen.add(s)
    return vocab[:VOCAB]


def write_tokenizer(path: Path) -> None:
    """``tokenizer.json`` (BPE over ``vocab_strings``, no merges: encoding splits into
    single characters, decoding concatenates pieces) + ``tokenizer_config.json``."""
    from tokenizers import AddedToken, Tokenizer, decoders
    from tokenizers.models import BPE

    vocab = {s: i for i, s in enumerate(vocab_strings())}
    assert len(vocab) == VOCAB
    tok = Tokenizer(BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.decoder = decoders.Fuse()
    save_with_bos(tok, path)


def save_with_bos(tok, path: Path) -> None:
    """Save ``tok`` (a ``tokenizers.Tokenizer`` with the tiny configs' specials) with a post-processor
    that adds ``<s>``, and the ``tokenizer_config.json`` naming the specials."""
    from tokenizers import processors

    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                       special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "<unk>", "model_max_length": 256,
        "add_bos_token": True, "add_eos_token": False,
    }, indent=2))


# -- reference computations --------------------------------------------------------------------

@torch.no_grad()
def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax over the vocab at every prompt position, fp32, [L, V]."""
    return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


@torch.no_grad()
def hf_generate(hf, ids: list[int], n: int, eos_token_id: int | None = None, logits_processor=None,
                **kwargs: Any):
    """Greedy ``hf.generate``. With ``eos_token_id=None`` HF knows no EOS at all, which is what
    ``ignore_eos=True`` means. (``min_new_tokens`` would instead mask EOS out of the argmax, and
    a ``generation_config`` passed to ``generate`` gets its ``None`` EOS refilled from the
    model's, so the model's own config is swapped for the call.) ``logits_processor``: a
    ``LogitsProcessorList`` run after the built-in ones."""
    saved = hf.generation_config
    gen_cfg = copy.deepcopy(saved)
    gen_cfg.eos_token_id = eos_token_id
    gen_cfg.pad_token_id = 0
    gen_cfg.do_sample = False
    gen_cfg.max_new_tokens = n
    for key, value in kwargs.items():
        setattr(gen_cfg, key, value)
    hf.generation_config = gen_cfg
    try:
        return hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           logits_processor=logits_processor)
    finally:
        hf.generation_config = saved


def hf_greedy(hf, ids: list[int], n: int, eos_token_id: int | None = None) -> list[int]:
    return hf_generate(hf, ids, n, eos_token_id)[0, len(ids):].tolist()


def prompt_ids(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()

