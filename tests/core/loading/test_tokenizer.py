"""Tokenizer (HF folders and GGUF metadata), chat templates, streaming detokenization.

transformers is the reference: its AutoTokenizer loads the same folder / GGUF
file, and its apply_chat_template renders the same template.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.gguf_fixtures import CORPUS, SPECIALS, write_tiny_gguf
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from lmplug.errors import ModelLoadError
from lmplug.loading.gguf import load_gguf
from lmplug.loading.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

STRINGS = [
    "Hello, world!",
    "  leading and trailing   ",
    "numbers 1234567890, 3.14159 and 1,000,000",
    "x² + y³ = z⁴ ½ ¼ Ⅻ ٣٤",
    "héllo wörld ñandú façade",
    "日本語のテキスト、中文，한국어",
    "emoji 🎉🚀👨‍👩‍👧 and ZWJ",
    "def f(x):\n    return x ** 2  # c\n\tpass",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after<|endoftext|>",
    "don't you'll I'm they've She'S",
    "tabs\tand\nnewlines\r\n\r\nmixed \n \n",
    "",
    " ",
    "\n\n\n",
    "https://example.com/path?q=1&r=2#frag",
    "αβγ Ωμέγα",
    "مرحبا بالعالم",
    "Ｆｕｌｌｗｉｄｔｈ",
]

TEMPLATE = """{{ bos_token }}
{% set ns = namespace(turns=0) %}
{% if tools %}
<|im_start|>system
Tools: {{ tools | tojson }}<|im_end|>
{% endif %}
{% for message in messages %}
    {% if message.role not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role: ' + message.role) }}
    {% endif %}
    {% if message.content == 'SKIP' %}{% continue %}{% endif %}
    {% set ns.turns = ns.turns + 1 %}
<|im_start|>{{ message.role }}
{{ message.content | trim }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think></think>
{% endif %}
{% endif %}"""

CHATS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  héllo <b>&</b>  "},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "SKIP"},
        {"role": "user", "content": "日本語 🎉"},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Wetter in Zürich <now>",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]


def byte_level_backend(merges: bool = True) -> Backend:
    """A byte-level BPE; with ``merges=False`` every byte is its own token."""
    tk = Backend(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400 if merges else 259,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(CORPUS * 5, trainer)
    return tk


def write_hf_dir(folder: Path, backend: Backend, **config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    base = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": {
            "__type": "AddedToken",
            "content": "<|im_start|>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        },
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    return folder


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    folder = write_hf_dir(tmp_path_factory.mktemp("hf") / "tiny-chat", byte_level_backend())
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return folder


@pytest.fixture(scope="module")
def hf_reference(hf_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(hf_dir))


# -- HF folders ---------------------------------------------------------------------------


def test_hf_dir_properties(hf_dir):
    tok = Tokenizer.from_hf_dir(hf_dir)
    assert tok.bos_token_id == 1 and tok.bos_token == "<|im_start|>"
    assert tok.eos_token_ids == frozenset({0, 2})  # generation_config list + tokenizer eos
    assert tok.vocab_size == 400
    assert tok.chat_template == TEMPLATE


@pytest.mark.hf
def test_hf_dir_encode_decode_match_transformers(hf_dir, hf_reference):
    tok = Tokenizer.from_hf_dir(hf_dir)
    for text in STRINGS:
        ids = tok.encode(text)
        assert ids == hf_reference(text)["input_ids"], text
        for skip in (True, False):
            assert tok.decode(ids, skip) == hf_reference.decode(ids, skip_special_tokens=skip), text


@pytest.mark.hf
@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("extra", [{}, {"tools": TOOLS}, {"enable_thinking": False}])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    hf_dir, hf_reference, chat, extra, add_generation_prompt
):
    ours = Tokenizer.from_hf_dir(hf_dir).apply_chat_template(
        chat, add_generation_prompt=add_generation_prompt, **extra
    )
    theirs = hf_reference.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
    )
    assert ours == theirs


def test_chat_template_raise_exception(hf_dir):
    tok = Tokenizer.from_hf_dir(hf_dir)
    with pytest.raises(ChatTemplateError, match="unknown role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_chat_template_is_sandboxed(tmp_path):
    folder = write_hf_dir(
        tmp_path / "evil", byte_level_backend(), chat_template="{{ messages.__class__.__mro__ }}"
    )
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        Tokenizer.from_hf_dir(folder).apply_chat_template([{"role": "user", "content": "x"}])


def test_invalid_chat_template_names_model(tmp_path):
    folder = write_hf_dir(tmp_path / "broken", byte_level_backend(), chat_template="{% for %}")
    with pytest.raises(ModelLoadError, match="'broken': chat template is not valid jinja"):
        Tokenizer.from_hf_dir(folder).apply_chat_template([{"role": "user", "content": "x"}])


def test_no_chat_template_names_model(tmp_path):
    folder = write_hf_dir(tmp_path / "base-model", byte_level_backend(), chat_template=None)
    with pytest.raises(ModelLoadError, match="'base-model' has no chat template"):
        Tokenizer.from_hf_dir(folder).apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_sources(tmp_path):
    backend = byte_level_backend()
    listed = write_hf_dir(
        tmp_path / "listed",
        backend,
        chat_template=[
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "DEFAULT"},
        ],
    )
    assert Tokenizer.from_hf_dir(listed).chat_template == "DEFAULT"
    own_file = write_hf_dir(tmp_path / "own-file", backend)
    (own_file / "chat_template.jinja").write_text("FROM JINJA FILE")
    assert Tokenizer.from_hf_dir(own_file).chat_template == "FROM JINJA FILE"
    json_file = write_hf_dir(tmp_path / "json-file", backend, chat_template=None)
    (json_file / "chat_template.json").write_text(json.dumps({"chat_template": "FROM JSON"}))
    assert Tokenizer.from_hf_dir(json_file).chat_template == "FROM JSON"


def test_bos_from_post_processor_when_config_is_silent(tmp_path):
    backend = byte_level_backend()
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    folder = write_hf_dir(tmp_path / "bos", backend, add_bos_token=None)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["add_bos_token"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    tok = Tokenizer.from_hf_dir(folder)
    assert tok.encode("hi")[0] == 1 and tok.encode("hi", add_special_tokens=False)[0] != 1
    assert tok.eos_token_ids == frozenset({0, 2})


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: not found"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: not a valid"):
        Tokenizer.from_hf_dir(tmp_path)
    folder = write_hf_dir(tmp_path / "bad-config", byte_level_backend())
    (folder / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json: not valid JSON"):
        Tokenizer.from_hf_dir(folder)


# -- GGUF metadata --------------------------------------------------------------------------


@pytest.mark.hf
@pytest.mark.parametrize(
    "vocab,pre",
    [
        ("byte", "smollm"),
        ("byte", "llama-bpe"),
        ("byte", "qwen2"),
        ("byte", "gpt2"),
        ("spm", "default"),
    ],
)
def test_gguf_tokenizer_matches_transformers(tmp_path, vocab, pre):
    transformers = pytest.importorskip("transformers")
    write_tiny_gguf(tmp_path / "m.gguf", vocab=vocab, pre=pre)
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    tok = load_gguf(tmp_path / "m.gguf").tokenizer
    assert tok.add_bos_token == (vocab == "spm")
    for text in STRINGS:
        ids = tok.encode(text)
        assert ids == reference(text)["input_ids"], text
        for skip in (True, False):
            assert tok.decode(ids, skip) == reference.decode(ids, skip_special_tokens=skip), text


def test_gguf_smollm_splits_every_numeric_character(tmp_path):
    # llama.cpp's "smollm" pre-tokenizer (and SmolLM's own tokenizer.json) isolate each
    # \p{N} character; transformers' GGUF loader has no entry for it and uses GPT-2's
    # split, which keeps " ½" together. We follow llama.cpp and the original model.
    write_tiny_gguf(tmp_path / "m.gguf", pre="smollm")
    pieces = load_gguf(tmp_path / "m.gguf").tokenizer.backend.pre_tokenizer.pre_tokenize_str(
        "a ½12"
    )
    assert [p for p, _ in pieces] == ["a", "Ġ", "Â½", "1", "2"]


def test_gguf_special_tokens_and_template(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf")
    tok = load_gguf(tmp_path / "m.gguf").tokenizer
    assert tok.encode("<|im_start|>hi<|im_end|>")[0] == 1 and tok.encode("<|im_end|>") == [2]
    assert tok.eos_token_ids == frozenset({2})
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


# -- streaming detokenization ----------------------------------------------------------------


def stream(tok: Tokenizer, prompt: list[int], output: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add([token]) for token in output]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("merges", [True, False])
def test_stream_deltas_concatenate_to_decode(hf_dir, tmp_path, merges):
    tok = Tokenizer.from_hf_dir(write_hf_dir(tmp_path / "t", byte_level_backend(merges)))
    prompt = tok.encode("<|im_start|>user\nsay it<|im_end|>")
    for text in ["héllo wörld", "日本語 and 🎉🚀 done", "plain ascii text", "👨‍👩‍👧x"]:
        output = tok.encode(text)
        deltas = stream(tok, prompt, output)
        assert "".join(deltas) == tok.decode(output) == text
        assert not any("\ufffd" in d for d in deltas)
    if not merges:  # every byte its own token: a 4-byte emoji must arrive whole
        assert stream(tok, [], tok.encode("🎉"))[:4] == ["", "", "", "🎉"]


def test_stream_in_random_chunks(tmp_path):
    # Speculative decoding hands the detokenizer several ids per step.
    import random

    tok = Tokenizer.from_hf_dir(write_hf_dir(tmp_path / "t", byte_level_backend(merges=False)))
    text = "mixed ascii, ümlauts, 日本語, and emoji 👨‍👩‍👧🎉 end"
    ids, rng = tok.encode(text), random.Random(0)
    for _ in range(20):
        detok, at, deltas = IncrementalDetokenizer(tok, tok.encode("prompt")), 0, []
        while at < len(ids):
            step = rng.randint(1, 5)
            deltas.append(detok.add(ids[at : at + step]))
            at += step
        deltas.append(detok.flush())
        assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)


def test_stream_holds_incomplete_character_until_flush(tmp_path):
    tok = Tokenizer.from_hf_dir(write_hf_dir(tmp_path / "t", byte_level_backend(merges=False)))
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add(tok.encode("ok 🎉")[:-2]) == "ok "
    assert detok.flush() == "\ufffd"  # the bytes never completed a character


def test_stream_skips_special_tokens(hf_dir):
    tok = Tokenizer.from_hf_dir(hf_dir)
    detok = IncrementalDetokenizer(tok, tok.encode("hi"))
    assert detok.add(tok.encode(" there")) == " there"
    assert detok.add([2]) == ""  # <|im_end|>
    assert detok.text == " there"


def test_stream_sentencepiece_spaces(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf", vocab="spm")
    tok = load_gguf(tmp_path / "m.gguf").tokenizer
    prompt = tok.encode("The quick")
    full = tok.encode("The quick brown fox jumps", add_special_tokens=True)
    assert full[: len(prompt)] == prompt
    deltas = stream(tok, prompt, full[len(prompt) :])
    assert "".join(deltas) == " brown fox jumps"
    assert (
        "".join(stream(tok, [], tok.encode("héllo 日本語", add_special_tokens=False)))
        == "héllo 日本語"
    )
