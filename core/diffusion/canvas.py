"""One canvas's denoising, step by step, as transformers' ``DiffusionGemmaGenerationMixin`` does
it for one sequence: the random canvas, the linear temperature schedule, a draw from every
position, the entropy-bound acceptance, the renoising of the rest, the stable-and-confident
stop. Random draws come from the sequence's generator in transformers' order (the canvas; then
per step the draw, then the renoising), so a seed gives transformers' tokens for that seed."""

from __future__ import annotations

import torch

from lmplug.interfaces.denoising import DenoisingParams


class Canvas:
    def __init__(self, params: DenoisingParams, length: int, vocab_size: int, generator: torch.Generator) -> None:
        self.params, self.length, self.vocab_size, self.generator = params, length, vocab_size, generator
        self.tokens = self._noise()  # the current (noisy) canvas
        self.argmax = self.tokens
        self.self_conditioning: torch.Tensor | None = None  # the last step's processed logits
        self.remaining = params.max_denoising_steps  # transformers' ``cur_step``: N down to 1
        self.history: torch.Tensor | None = None  # the last argmax canvases (stability)
        self.steps = 0
        self.done = False

    def _noise(self) -> torch.Tensor:
        return torch.randint(0, self.vocab_size, (self.length,), generator=self.generator)

    def step(self, logits: torch.Tensor) -> None:
        """One denoising step from the decoder's logits [canvas, V] (soft-capped, float32)."""
        p = self.params
        scaled = logits.float() / (p.t_min + (p.t_max - p.t_min) * (self.remaining / p.max_denoising_steps))
        probs = torch.softmax(scaled, dim=-1, dtype=torch.float32)
        drawn = torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(-1)
        self.argmax = scaled.argmax(dim=-1)
        entropy = torch.distributions.Categorical(logits=scaled).entropy()
        ordered, order = torch.sort(entropy, dim=-1, descending=False)
        chosen = torch.cumsum(ordered, dim=-1) - ordered <= p.entropy_bound
        accepted = torch.scatter(torch.zeros_like(chosen), -1, order, chosen)
        kept = torch.where(accepted, drawn, self.tokens)
        self.tokens = torch.where(~accepted, self._noise(), kept)
        self.self_conditioning = scaled
        self.steps += 1
        self.remaining -= 1
        self.done = self._stop(self.argmax, entropy) or self.remaining == 0

    def _stop(self, argmax: torch.Tensor, entropy: torch.Tensor) -> bool:
        threshold = self.params.stability_threshold
        if threshold == 0:
            stable = True
        else:
            if self.history is None:
                self.history = torch.full((threshold, self.length), -1, dtype=argmax.dtype)
            stable = bool((self.history == argmax[None]).all())
            self.history = torch.roll(self.history, shifts=-1, dims=0)
            self.history[-1] = argmax
        return stable and bool(entropy.mean() < self.params.confidence_threshold)
