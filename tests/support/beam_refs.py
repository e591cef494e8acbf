"""References for beam search tests: transformers' own beam search on a tiny model."""

from __future__ import annotations

from support.hf_models import hf_generate


def hf_beams(hf, ids, *, width, n, max_new, eos, length_penalty=1.0, early_stopping=False, min_new=0):
    out = hf_generate(hf, ids, max_new, eos_token_id=eos, num_beams=width, num_return_sequences=n,
                      length_penalty=length_penalty, early_stopping=early_stopping, min_new_tokens=min_new,
                      return_dict_in_generate=True, output_scores=True)
    seqs = []
    for row in out.sequences[:, len(ids):].tolist():
        if eos is not None and eos in row:
            row = row[:row.index(eos) + 1]  # the rest is padding (pad = eos here)
        seqs.append(row)
    return seqs, out.sequences_scores.tolist()


def frequent_token(hf, ids, steps=12) -> int:
    """A token the random model emits often in greedy decoding: an EOS that beams do reach."""
    out = hf_generate(hf, ids, steps)[0, len(ids):].tolist()
    return max(set(out), key=out.count)
