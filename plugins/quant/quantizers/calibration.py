"""Calibration and held-out text that ships with Python: the pydoc topics.

``pydoc_data.topics.topics`` is the English help text of Python's statements
and data model (~465k characters), present in every CPython install, so
quantizing needs no download. The split is deterministic: the topics, sorted
by name, are joined and cut into paragraphs; each distinct paragraph is kept
once (topics repeat whole sections, which would leak held-out text into the
calibration set), and they are grouped into blocks of at least
``BLOCK_CHARS`` characters; every tenth block (``HELDOUT_EVERY``) is held out
for evaluation (~10%, ~11k tokens for a 49k-token BPE vocabulary) and the
rest calibrates. Calibration windows are ``num_samples`` slices of ``seq_len``
tokens at evenly spaced offsets of the tokenized calibration text.
"""

from __future__ import annotations

import torch

from lmplug.api import CalibrationSpec
from lmplug.errors import ConfigError

HELDOUT_EVERY = 10
BLOCK_CHARS = 2000


def pydoc_split() -> tuple[str, str]:
    """``(calibration_text, heldout_text)``."""
    from pydoc_data.topics import topics

    paragraphs = "\n\n".join(topics[name] for name in sorted(topics)).split("\n\n")
    blocks, current = [], []
    for paragraph in dict.fromkeys(paragraphs):  # topics repeat sections: keep each paragraph once
        current.append(paragraph)
        if sum(len(p) for p in current) >= BLOCK_CHARS:
            blocks.append("\n\n".join(current))
            current = []
    if current:
        blocks.append("\n\n".join(current))
    calib = [b for i, b in enumerate(blocks) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    held = [b for i, b in enumerate(blocks) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    return "\n\n".join(calib), "\n\n".join(held)


def heldout_text() -> str:
    return pydoc_split()[1]


def calibration_windows(tokenizer, spec: CalibrationSpec) -> torch.Tensor:
    """``[num_samples, seq_len]`` token ids (int64) from the calibration text."""
    if tokenizer is None:
        raise ConfigError("the model has no tokenizer, which calibration needs to tokenize text")
    if spec.num_samples < 1 or spec.seq_len < 2:
        raise ConfigError(f"--calib-samples {spec.num_samples} / --calib-len {spec.seq_len}: "
                          "need at least 1 sample of at least 2 tokens")
    ids = torch.tensor(tokenizer.encode(pydoc_split()[0], add_special_tokens=False), dtype=torch.int64)
    if len(ids) < spec.seq_len:
        raise ConfigError(f"--calib-len {spec.seq_len}: the calibration text has only {len(ids)} tokens")
    starts = torch.linspace(0, len(ids) - spec.seq_len, spec.num_samples).long()
    return torch.stack([ids[s:s + spec.seq_len] for s in starts.tolist()])
