"""The demo GGUF (SmolLM2-135M-Instruct Q4_1): loading speed, and tokenizer, chat template
and weights against transformers loading the same file. Skipped when the model is absent."""

from __future__ import annotations

import time

import pytest
import torch

from lmplug.loading.gguf import load_gguf

STRINGS = [
    "Hello, world!",
    "  leading spaces and trailing   ",
    "numbers 1234567890 and 3.14159, 1,000,000",
    "x²+y³=z",
    "héllo wörld ñandú façade",
    "日本語のテキスト、中文文本，한국어",
    "emoji 🎉🚀👨‍👩‍👧 and ZWJ",
    "def f(x):\n    return x ** 2  # comment\n\tpass",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after<|endoftext|>",
    "don't you'll I'm they've we'd She'S",
    "tabs\tand\nnewlines\r\n\r\nmixed \n \n",
    "",
    " ",
    "\n\n\n",
    "https://example.com/path?q=1&r=2#frag",
    "SELECT * FROM users WHERE id = 42;",
    "αβγ δεζ Ωμέγα",
    "مرحبا بالعالم",
    "a" * 50 + " " + "ab" * 20,
    "<repo_name>lmplug<file_sep>main.py",
    "Ｆｕｌｌｗｉｄｔｈ",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "日本語 🎉"},
    ],
]


@pytest.fixture(scope="module")
def source(demo_gguf):
    return load_gguf(demo_gguf)


@pytest.fixture(scope="module")
def hf_tokenizer(demo_gguf):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(demo_gguf.parent), gguf_file=demo_gguf.name
    )


def test_loads_all_tensors_quickly(demo_gguf):
    # CPU time, so that other work on a shared machine does not make this flaky (~2 s here).
    started = time.process_time()
    source = load_gguf(demo_gguf)
    shapes = {name: tensor.shape for name, tensor in source.iter_tensors()}
    elapsed = time.process_time() - started
    assert len(shapes) == 272 and elapsed < 5.0, f"{elapsed:.2f} s"
    assert shapes["model.embed_tokens.weight"] == (49152, 576)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (192, 576)


def test_config(source):
    config = source.hf_config
    assert {
        k: config[k]
        for k in (
            "model_type",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "tie_word_embeddings",
            "rope_theta",
            "vocab_size",
        )
    } == {
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "tie_word_embeddings": True,
        "rope_theta": 100000.0,
        "vocab_size": 49152,
    }
    assert source.tokenizer.eos_token_ids == frozenset({2})  # <|im_end|>
    assert source.tokenizer.add_bos_token is False


@pytest.mark.hf
def test_tokenizer_matches_transformers(source, hf_tokenizer):
    tok = source.tokenizer
    assert tok.vocab_size == len(hf_tokenizer)
    for text in STRINGS:
        ids = tok.encode(text)
        assert ids == hf_tokenizer(text)["input_ids"], text
        for skip in (True, False):
            assert tok.decode(ids, skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip), text


def test_numeric_characters_split_like_llama_cpp(source):
    # Deliberate difference from transformers' GGUF tokenizer, which has no "smollm" entry and
    # keeps " ½" together (-> "ĠÂ", "½"). llama.cpp and SmolLM2's own tokenizer.json isolate
    # every numeric character first, giving " " and "½" apart.
    vocab = source.tokenizer.backend.get_vocab()
    assert source.tokenizer.encode("a ½") == [vocab["a"], vocab["Ġ"], vocab["Â½"]]


@pytest.mark.hf
@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(source, hf_tokenizer, chat, add_generation_prompt):
    ours = source.tokenizer.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs


@pytest.mark.slow
@pytest.mark.hf
def test_weights_match_transformers(demo_gguf, source):
    """~30 s: transformers dequantizes and un-permutes the same file."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(demo_gguf.parent),
        gguf_file=demo_gguf.name,
        dtype=torch.float32,
        quantization_config=transformers.GgufConfig(dequantize=True),
    )
    reference = model.state_dict()
    for name, tensor in source.iter_tensors():
        torch.testing.assert_close(tensor, reference[name], atol=0, rtol=0, msg=name)
