"""References for beam search tests: transformers' own beam search on a tiny model."""

from __future__ import annotations

import torch

from support.hf_models import hf_generate


def hf_beams(hf, ids, *, width, n, max_new, eos, length_penalty=1.0, early_stopping=False, min_new=0,
             logits_processor=None):
    out = hf_generate(hf, ids, max_new, eos_token_id=eos, logits_processor=logits_processor,
                      num_beams=width, num_return_sequences=n,
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


def matcher_mask(make_matcher, prompt_len: int, ends: set[int]):
    """A transformers ``LogitsProcessorList`` masking each beam's log-probs (beam search hands
    processors the log-softmax) by a fresh matcher (``make_matcher()``) fed the beam's new
    tokens; a beam holding an end token or a token its matcher refuses allows nothing. The
    bitmask is read bit by bit (bit ``t % 32`` of word ``t // 32``)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from lmplug.interfaces.constraint import new_bitmask

    class MatcherMask(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores = scores.clone()
            ids = torch.arange(scores.shape[-1])
            for row, tokens in enumerate(input_ids[:, prompt_len:].tolist()):
                matcher = make_matcher()
                if any(t in ends for t in tokens) or not all(matcher.accept(t) for t in tokens):
                    scores[row] = float("-inf")
                    continue
                words = new_bitmask(1, scores.shape[-1])
                matcher.fill_mask(words[0])
                bits = (words[0].long() & 0xFFFFFFFF)[ids // 32] >> (ids % 32) & 1
                scores[row, bits == 0] = float("-inf")
            return scores

    return LogitsProcessorList([MatcherMask()])
