"""Tiny random encoders (BERT, RoBERTa, XLM-RoBERTa) built by transformers, with a real WordPiece
tokenizer, saved by sentence-transformers with their pooling modules: what encoder embedding tests load."""

from __future__ import annotations

import string

import torch

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def write_tokenizer(path) -> int:
    """A WordPiece vocabulary of single characters (every word splits into them) saved as HF does."""
    from transformers import BertTokenizerFast

    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    vocab = SPECIALS + chars + ["##" + c for c in chars] + ["the", "tea", "##ea"]
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(str(path / "vocab.txt")).save_pretrained(str(path))
    return len(vocab)


def encoder_folder(root, model_type: str, mode: str, normalize: bool) -> str:
    """A tiny random ``model_type`` encoder saved by sentence-transformers: Transformer -> Pooling(mode)
    [-> Normalize]."""
    from sentence_transformers import SentenceTransformer, models
    from transformers import AutoConfig, AutoModel

    base = root / f"{model_type}-base"
    vocab = write_tokenizer(base)
    # RoBERTa's position table starts past the padding index: 2 more rows for 64 positions
    extra = {"pad_token_id": 0, "max_position_embeddings": 66} if model_type != "bert" else {
        "max_position_embeddings": 64}
    config = AutoConfig.for_model(model_type, vocab_size=vocab, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, **extra)
    torch.manual_seed(0)
    model = AutoModel.from_config(config).eval()
    with torch.no_grad():  # random LayerNorm affine too, so a swapped weight and bias would show
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
    model.save_pretrained(str(base))
    path = root / f"{model_type}-{mode}-{normalize}"
    modules = [models.Transformer(str(base)), models.Pooling(32, pooling_mode=mode)]
    SentenceTransformer(modules=modules + [models.Normalize()] * normalize, device="cpu").save(str(path))
    return str(path)
