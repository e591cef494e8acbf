"""``medusa``: extra decoding heads on the target's last hidden state (Cai et al., 2024).

After each step the engine hands this drafter (``observe``) the target's final hidden
state at every sequence's last computed position; from it head ``i`` proposes token
``i + 1`` after the sequence's last token, all heads in one batched pass — no draft
model, no draft KV cache. Candidates form a chain (each head's top choice, or a sample
from its filtered distribution for sampling requests, returned as ``probs``); tree
candidates with tree attention are not implemented.

Heads load from the FasterDecoding format (``medusa_heads.py``); train some for any
model with ``lmplug train-drafter --method medusa MODEL OUT`` (``medusa_train.py``).
When a head's output matrix equals the target's ``lm_head`` (heads trained here keep it
frozen), the target's head is used, so all heads share one matrix multiply.
"""

from __future__ import annotations

import torch
from lmplug_speculative.medusa_heads import MedusaHeads, load_heads
from pydantic import Field

from lmplug.engine.sampler import draw, processed_logits
from lmplug.errors import ConfigError
from lmplug.interfaces import Capabilities, Drafter, DrafterOptions, DraftProposal, DraftTarget


class MedusaOptions(DrafterOptions):
    heads: str = Field(description="folder with medusa_lm_head.safetensors (or .pt) and config.json")


class MedusaDrafter(Drafter):
    name = "medusa"
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}))
    Options = MedusaOptions
    uses_hidden_states = True

    def setup(self, target: DraftTarget) -> None:
        heads = load_heads(self.options.heads)
        cfg = target.model_config
        weight = heads.head_weights()[0]
        if weight.shape != (cfg.vocab_size, cfg.hidden_size):
            raise ConfigError(f"speculative: medusa: heads {self.options.heads} output [{weight.shape[0]}, "
                              f"{weight.shape[1]}] but the target has vocab {cfg.vocab_size}, hidden "
                              f"{cfg.hidden_size}")
        self._shares_lm_head = _equals_lm_head(heads, target.model)  # (in the stored dtype)
        self.heads: MedusaHeads = heads.to(target.device, target.dtype).eval()
        self._compute_logits = target.model.compute_logits
        self._hidden: dict[int, tuple[torch.Tensor, int]] = {}  # seq_id -> (hidden [h], num_tokens)

    @classmethod
    def train(cls, model: str, out: str, options: dict) -> None:
        from lmplug_speculative.medusa_train import train_medusa

        train_medusa(model, out, options)

    def observe(self, seqs, hidden: torch.Tensor) -> None:
        for seq, row in zip(seqs, hidden):
            self._hidden[seq.seq_id] = (row, seq.num_tokens)

    def release(self, seq) -> None:
        self._hidden.pop(seq.seq_id, None)

    @torch.inference_mode()
    def propose(self, seqs, num_tokens: int) -> DraftProposal:
        k = min(num_tokens, len(self.heads))
        # a hidden state is usable only while the sequence still ends with the token it chose
        ready = [i for i, s in enumerate(seqs)
                 if self._hidden.get(s.seq_id, (None, -1))[1] == s.num_tokens]
        ids: list[list[int]] = [[] for _ in seqs]
        if not ready:
            return DraftProposal(ids)
        hidden = torch.stack([self._hidden[seqs[i].seq_id][0] for i in ready])  # [B, h]
        logits = self._head_logits(self.heads.blocks(hidden, k)).float()  # [k, B, V]
        chosen = [seqs[i] for i in ready]
        if all(s.params.is_greedy for s in chosen):
            for b, i in enumerate(ready):
                ids[i] = logits[:, b].argmax(-1).tolist()
            return DraftProposal(ids)
        probs: list[torch.Tensor | None] = [None] * len(seqs)
        for b, i in enumerate(ready):
            ids[i], probs[i] = _sample_chain(logits[:, b], seqs[i])
        return DraftProposal(ids, probs)

    def _head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [k, B, h] -> [k, B, V] through each head's output matrix."""
        k, b, h = x.shape
        if self._shares_lm_head:
            return self._compute_logits(x.reshape(k * b, h)).view(k, b, -1)
        weights = torch.stack(self.heads.head_weights()[:k])  # [k, V, h]
        return torch.bmm(x, weights.transpose(1, 2))


def _sample_chain(logits: torch.Tensor, seq) -> tuple[list[int], torch.Tensor]:
    """One sequence's heads' logits [k, V] -> drafted tokens and the distributions drawn from."""
    q = processed_logits(logits, [seq.params] * logits.shape[0]).softmax(-1)
    if seq.params.is_greedy:  # a point mass on the argmax
        tokens = logits.argmax(-1).tolist()
        q = torch.zeros_like(q).scatter_(1, torch.tensor(tokens).unsqueeze(1), 1.0)
        return tokens, q
    return [draw(row, seq.generator) for row in q], q


def _equals_lm_head(heads: MedusaHeads, model: torch.nn.Module) -> bool:
    head = getattr(model, "lm_head", None)
    if head is None and getattr(model, "embed_tokens", None) is not None:
        head = model.embed_tokens.weight  # tied embeddings
    if not isinstance(head, torch.Tensor):
        return False
    return all(w.shape == head.shape and torch.equal(w, head.to(w.dtype)) for w in heads.head_weights())
