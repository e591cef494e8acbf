"""``dflash``: draft a block per step with a masked block-diffusion head (DFlash; transformers'
``muse_glimmer_assistant``, driven there by ``DFlashTokenCandidateGenerator``).

The head reads the target's hidden states at its ``target_layer_ids``: forward hooks on those
layers of the target (``ContextStore``) project each step's rows to the head's *context*
(``encoder``: fc over the concatenated layers, then an RMSNorm) and keep them by KV slot, so they
live exactly as long as the target's K/V, paged or contiguous, prefix cache included (the
scheme of ``feature_store``). Hooks need the target's Python layers: the drafter turns off the
CPU's native decode step (``cpu.native_step``), which runs every layer in one C call.

Per sequence the drafter keeps each head layer's K/V of the context positions the target has
computed (0..C-1), as the reference's ``DFlashCache`` does; after a rejection it keeps them up
to the first position whose token changed and recomputes the rest from the store. ``propose``
is one forward of the head per step for the whole batch: the block [anchor, mask ×
(block_size - 1)] at positions C..C+block_size-1 (the anchor is the last accepted token, whose
K/V the target has not computed), embedded with the target's embedding, attending to the
context and bidirectionally to itself; its rows 1..k go through the target's LM head and give
the k drafts at once (one denoising pass, as the reference). Greedy requests take each row's
argmax; sampling requests draw each row with the request's filters and generator and return the
rows as ``probs``, so the verifier's exact rule keeps the target's distribution (a row's draft
distribution does not depend on the other drafts, which the rule allows).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from lmplug_speculative.dflash_head import DFlashHead, load_head
from lmplug_speculative.draft_runner import choose_tokens, common_prefix
from lmplug_speculative.feature_store import FeatureStore
from pydantic import Field

from lmplug.api import (
    Capabilities,
    Drafter,
    DrafterOptions,
    DraftProposal,
    DraftTarget,
    StepContext,
)
from lmplug.errors import ConfigError


class DFlashOptions(DrafterOptions):
    num_tokens: int | None = Field(default=None, ge=1, le=64, description="drafts per step (k): at most the "
                                                                         "head's block_size - 1, which is the "
                                                                         "default")
    heads: str = Field(description="folder with config.json (model_type muse_glimmer_assistant) and "
                                   "model.safetensors of a DFlash block-diffusion head")


class DFlashDrafter(Drafter):
    name = "dflash"
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda"}))
    Options = DFlashOptions

    def setup(self, target: DraftTarget) -> None:
        cfg = target.model_config
        head = load_head(self.options.heads, max_position=target.max_model_len + 64)
        hc = head.config
        folder = self.options.heads
        layers = getattr(target.model, "layers", None)
        embed = getattr(target.model, "embed_tokens", None)
        if layers is None or embed is None:
            raise ConfigError(f"speculative: dflash: the target model {type(target.model).__name__} exposes no "
                              f"decoder layers and embedding to read hidden states from")
        if hc.model.hidden_size != cfg.hidden_size:
            raise ConfigError(f"speculative: dflash: heads {folder} have hidden_size {hc.model.hidden_size}, the "
                              f"target {cfg.hidden_size}")
        bad = [i for i in hc.target_layer_ids if i >= len(layers)]
        if bad:
            raise ConfigError(f"speculative: dflash: heads {folder}: target_layer_ids {list(hc.target_layer_ids)} "
                              f"name layers {bad} the target (with {len(layers)} layers) lacks")
        if hc.mask_token_id >= cfg.vocab_size:
            raise ConfigError(f"speculative: dflash: heads {folder}: mask_token_id {hc.mask_token_id} is outside "
                              f"the target's vocabulary of {cfg.vocab_size}")
        most = hc.block_size - 1
        if self.options.num_tokens is None:
            self.options = self.options.model_copy(update={"num_tokens": most})
        elif self.options.num_tokens > most:
            raise ConfigError(f"speculative: dflash: num_tokens {self.options.num_tokens} is more than the heads' "
                              f"block_size {hc.block_size} - 1 = {most} (one block per step: the anchor and "
                              f"{most} masked positions)")
        if hasattr(target.model, "allow_native_step"):
            target.model.allow_native_step(False)  # the store's hooks read each layer's output
        self.head: DFlashHead = head.to(target.device, target.dtype).eval().requires_grad_(False)
        self.store = ContextStore(target.model, target.kv, self.head, target.dtype, target.device)
        self._embed = embed
        self._embed_scale = getattr(target.model, "embedding_multiplier", 1.0)  # Gemma's, as HF's embedding
        self._compute_logits = target.model.compute_logits
        self.vocab = cfg.vocab_size
        self.max_len = target.max_model_len
        self.device = target.device
        self._states: dict[int, _Context] = {}

    @classmethod
    def train(cls, host, model: str, out: str, options: dict) -> None:
        from lmplug_speculative.dflash_train import train_dflash

        train_dflash(host, model, out, options)

    def release(self, seq) -> None:
        self._states.pop(seq.seq_id, None)

    @torch.inference_mode()
    def propose(self, seqs, num_tokens: int) -> DraftProposal:
        if not hasattr(self, "head"):
            raise RuntimeError("drafter 'dflash': setup(target) was not called")
        ids: list[list[int]] = [[] for _ in seqs]
        active = []  # (index in seqs, its context state, drafts wanted)
        for i, seq in enumerate(seqs):
            steps = min(num_tokens, self.options.num_tokens, self.max_len - seq.num_tokens)
            if seq.num_tokens < 2 or steps < 1:
                continue
            active.append((i, self._sync(seq), steps))
        if not active:
            return DraftProposal(ids)
        out = self._block([seqs[i] for i, _, _ in active], [s for _, s, _ in active])
        rows = [(b, i, j) for b, (i, _, steps) in enumerate(active) for j in range(steps)]
        logits = self._compute_logits(out[[b for b, _, _ in rows], [1 + j for _, _, j in rows]])
        sampling = any(not seqs[i].params.is_greedy for i, _, _ in active)
        chosen, q = choose_tokens(logits, [seqs[i] for _, i, _ in rows], sampling, self.vocab)
        for (_, i, _), token in zip(rows, chosen):
            ids[i].append(token)
        if q is None:
            return DraftProposal(ids)
        probs: list[torch.Tensor | None] = [None] * len(seqs)
        for i, _, _ in active:
            probs[i] = q[[r for r, (_, owner, _) in enumerate(rows) if owner == i]]
        return DraftProposal(ids, probs)

    def _sync(self, seq) -> _Context:
        """The head's context K/V of ``seq`` for positions 0..C-1 (C: what the target computed),
        kept up to the first changed token and computed from the store past it."""
        c = seq.num_tokens - 1
        state = self._states.get(seq.seq_id)
        if state is None:
            state = self._states[seq.seq_id] = _Context()
        valid = common_prefix(state.tokens, seq.token_ids, state.length)
        state.truncate(valid)
        if valid < c:
            positions = torch.arange(valid, c, device=self.device)
            kv = self.head.context_kv(self.store.read(seq, valid, c), positions)
            state.append(kv, seq.token_ids[valid:c])
        return state

    def _block(self, seqs, states: list[_Context]) -> torch.Tensor:
        """The head's output [B, block_size, h] for each sequence's block."""
        cfg = self.head.config
        size, longest = cfg.block_size, max(s.length for s in states)
        anchors = torch.tensor([seq.token_ids[-1] for seq in seqs], device=self.device)
        noise = torch.cat([anchors[:, None], anchors.new_full((len(seqs), size - 1), cfg.mask_token_id)], 1)
        embeds = self._embed(noise.reshape(-1)).view(len(seqs), size, -1)
        if self._embed_scale != 1.0:
            embeds = embeds * self._embed_scale
        starts = torch.tensor([s.length for s in states], device=self.device)
        positions = starts[:, None] + torch.arange(size, device=self.device)
        past_positions = torch.arange(longest, device=self.device).expand(len(seqs), longest)
        past = [(torch.stack([s.padded(layer, 0, longest) for s in states]),
                 torch.stack([s.padded(layer, 1, longest) for s in states])) for layer in range(len(cfg.sliding))]
        return self.head(embeds, positions, past, past_positions, past_positions < starts[:, None])


@dataclasses.dataclass
class _Context:
    """One sequence's context K/V per head layer, [layers, Hkv, capacity, D] (grown by doubling),
    and the target tokens at those positions (to find what a rejection invalidated)."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    length: int = 0

    def truncate(self, n: int) -> None:
        self.length = min(self.length, n)
        del self.tokens[self.length:]

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]], tokens: list[int]) -> None:
        k, v = torch.stack([a for a, _ in kv]), torch.stack([b for _, b in kv])  # [L, Hkv, n, D]
        end = self.length + k.shape[2]
        if self.k is None or end > self.k.shape[2]:
            cap = max(end, 2 * (0 if self.k is None else self.k.shape[2]), 16)
            grown_k, grown_v = (k.new_zeros(*k.shape[:2], cap, k.shape[3]) for _ in range(2))  # masked, never NaN
            if self.k is not None:
                grown_k[:, :, :self.length] = self.k[:, :, :self.length]
                grown_v[:, :, :self.length] = self.v[:, :, :self.length]
            self.k, self.v = grown_k, grown_v
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        self.tokens.extend(tokens)

    def padded(self, layer: int, which: int, length: int) -> torch.Tensor:
        """Layer ``layer``'s K (0) or V (1) over ``length`` positions [Hkv, length, D] (zeros past ours)."""
        t = (self.k if which == 0 else self.v)[layer]
        if t.shape[1] >= length:
            return t[:, :length]
        return torch.nn.functional.pad(t, (0, 0, 0, length - t.shape[1]))


class ContextStore(FeatureStore):
    """``FeatureStore`` of the head's context: each step, the outputs of the target's layers
    ``target_layer_ids`` (the last layer's after the final norm, as transformers' hidden states
    have it), concatenated and projected by the head's encoder, stored by KV slot."""

    def __init__(self, model: torch.nn.Module, kv, head: DFlashHead, dtype: torch.dtype,
                 device: torch.device) -> None:
        self._ids = head.config.target_layer_ids
        self._project = head.project
        self._outputs: dict[int, torch.Tensor] = {}
        last = len(model.layers) - 1
        self._layer_handles = [model.layers[i].register_forward_hook(functools.partial(self._take, i))
                               for i in sorted(set(self._ids)) if i != last]
        self._last = last
        super().__init__(model, kv, head.config.model.hidden_size, dtype, device)

    def _take(self, index: int, module, args, output) -> None:
        if isinstance(output, torch.Tensor):
            self._outputs[index] = output.detach().clone()  # later layers may write in place

    def _record(self, module, args, output) -> None:
        ctx = next((a for a in args if isinstance(a, StepContext)), None)
        outputs, self._outputs = self._outputs, {}
        if ctx is None or not isinstance(output, torch.Tensor) or output.shape[0] != ctx.slot_mapping.shape[0]:
            return
        parts = [output if i == self._last else outputs.get(i) for i in self._ids]
        if any(p is None or p.shape != output.shape for p in parts):
            raise RuntimeError("drafter 'dflash': a target layer's output was not recorded (layers must return "
                               "their hidden states [T, h])")
        context = self._project(torch.cat(parts, -1).to(self.features.dtype))
        self.features.index_copy_(0, ctx.slot_mapping, context)

    def close(self) -> None:
        for handle in self._layer_handles:
            handle.remove()
        super().close()
