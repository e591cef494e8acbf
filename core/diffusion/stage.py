"""The denoising select stage: block diffusion beside the sampler, the speculator and beam search.

A block-diffusion model (one whose module sets ``block_diffusion``, e.g. DiffusionGemma) writes
its KV cache with a causal encoder and denoises each canvas with a bidirectional decoder. Per
sequence (every request to such a model is this stage's):

1. The prompt runs as usual (chunked, causal: the encoder writes its K/V). The step that catches
   it up starts a canvas (``Canvas``: random tokens from the sequence's generator) and emits
   nothing.
2. Each following step, ``propose`` asks for the canvas's ``canvas_length`` positions past the
   sequence's tokens (its lookahead) and ``plan`` puts the canvas there as one row with an
   all-ones mask (bidirectional inside the canvas; the cached prefix is always seen) and the
   previous step's logits as the row's inputs (self-conditioning); ``select`` strips the canvas
   and takes one denoising step from the row's logits. The decoder's K/V went to the canvas's
   slots: ``settle`` rolls the computed count back, so the cache keeps the encoder's only.
3. When the canvas stops (stable and confident, or out of steps), ``select`` emits its argmax
   tokens (one output delta per canvas; EOS, stop strings and ``max_tokens`` end it as anywhere).
   They are not computed yet: the next step runs them as a causal chunk, the encoder pass that
   writes their K/V, and the step that catches up starts the next canvas.

A row the scheduler cut short of the whole canvas (the token budget) denoises nothing that step.
A sequence preempted (recomputed) keeps its canvas here; its catch-up after the recompute does
not start another.
"""

from __future__ import annotations

from typing import Any

import torch

from lmplug.diffusion.canvas import Canvas
from lmplug.errors import ConfigError
from lmplug.interfaces.denoising import DenoisingParams
from lmplug.interfaces.params import SamplingParams
from lmplug.interfaces.scheduler import ScheduledSeq
from lmplug.interfaces.sequence import Sequence, SequenceStatus

# SamplingParams fields that shape an autoregressive draw, and their neutral values
_AUTOREGRESSIVE = {"n": 1, "best_of": None, "beam_width": 0, "temperature": 1.0, "top_k": (0, -1), "top_p": 1.0,
                   "min_p": 0.0, "logprobs": None, "prompt_logprobs": None, "presence_penalty": 0.0,
                   "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": (None, {}),
                   "min_tokens": 0, "structured": None, "exact": False}


class DenoisingStage:
    def __init__(self, model: torch.nn.Module, kv, vocab_size: int, max_model_len: int,
                 max_num_batched_tokens: int, model_name: str) -> None:
        self.diffusion = bool(getattr(model, "block_diffusion", False))
        self.canvas_length = int(getattr(model, "canvas_length", 0))
        self.kv, self.vocab_size, self.max_model_len = kv, vocab_size, max_model_len
        self.max_num_batched_tokens, self.model_name = max_num_batched_tokens, model_name
        self._canvases: dict[int, Canvas] = {}
        self._proposed: set[int] = set()
        self._planned: dict[int, tuple[int, int]] = {}  # seq_id -> (tokens before the canvas, rows run)
        self.num_steps = self.num_canvases = self.num_tokens = 0

    def claims(self, params: SamplingParams) -> bool:
        return self.diffusion or params.denoising is not None

    def admit(self, params: SamplingParams) -> None:
        """Refuse a denoising request to another model, and on a block-diffusion model any
        autoregressive option (named) or a canvas other than the model's."""
        if not self.diffusion:
            raise ConfigError(f"SamplingParams.denoising: model {self.model_name!r} is not a block-diffusion model (no canvas "
                              "to denoise); remove `denoising` or serve a DiffusionGemma checkpoint")
        for name, neutral in _AUTOREGRESSIVE.items():
            value = getattr(params, name)
            if value not in (neutral if isinstance(neutral, tuple) else (neutral,)):
                raise ConfigError(f"SamplingParams.{name}={value!r} is not an option of block-diffusion denoising (model "
                                  f"{self.model_name!r}): its draws are set by `denoising` (max_denoising_steps, "
                                  "t_min, t_max, entropy_bound, stability_threshold, confidence_threshold)")
        denoising = params.denoising or DenoisingParams()
        if denoising.canvas_length not in (None, self.canvas_length):
            raise ConfigError(f"SamplingParams.denoising.canvas_length={denoising.canvas_length} is out of range: model "
                              f"{self.model_name!r} denoises canvases of {self.canvas_length} tokens (config.json "
                              "canvas_length); leave it unset")
        if self.canvas_length > self.max_num_batched_tokens:
            raise ConfigError(f"scheduler.max_num_batched_tokens={self.max_num_batched_tokens} is below the "
                              f"canvas of {self.canvas_length} tokens, which one step must run whole")

    # -- before scheduling -----------------------------------------------------------------------
    def propose(self, seqs: list[Sequence]) -> dict[int, int]:
        """Each sequence with a canvas to denoise asks for the canvas's positions."""
        self._proposed = {s.seq_id for s in seqs if s.seq_id in self._canvases
                          and s.status is SequenceStatus.RUNNING and s.num_computed_tokens == s.num_tokens}
        return {seq_id: self.canvas_length for seq_id in self._proposed}

    def plan(self, scheduled: list[ScheduledSeq]) -> None:
        """The canvas (or as much of it as the scheduler fit) as one bidirectional row."""
        for item in scheduled:
            seq = item.seq
            if seq.seq_id not in self._proposed or item.num_new_tokens == 0:
                continue
            canvas, n, start = self._canvases[seq.seq_id], item.num_new_tokens, seq.num_tokens
            seq.extend_tokens(canvas.tokens[:n].tolist())
            item.positions = list(range(start, start + n))
            item.mask = torch.ones(n, n, dtype=torch.bool)
            item.num_logit_rows = n
            item.inputs = canvas.self_conditioning if n == self.canvas_length else None
            self._planned[seq.seq_id] = (start, n)
        self._proposed = set()

    # -- after the forward -----------------------------------------------------------------------
    def select(self, logits: torch.Tensor, num_rows: list[int], seqs: list[Sequence],
               hidden: torch.Tensor | None = None, on_error=None) -> tuple[list[list[int]], list[list[int]]]:
        emitted: list[list[int]] = []
        rows: list[list[int]] = []
        start = 0
        for seq, n in zip(seqs, num_rows):
            try:
                tokens = self._advance(seq, logits[start:start + n])
            except Exception as exc:
                if on_error is None:
                    raise
                on_error(seq, exc)
                tokens = []
            emitted.append(tokens)
            rows.append([start + min(j, n - 1) for j in range(len(tokens))])
            start += n
        return emitted, rows

    def _advance(self, seq: Sequence, logits: torch.Tensor) -> list[int]:
        planned = self._planned.get(seq.seq_id)
        if planned is None:  # an encoder pass caught up (the prompt, or a committed canvas)
            if seq.seq_id in self._canvases:  # recomputed after a preemption: its canvas goes on
                return []
            if seq.num_tokens + self.canvas_length > self.max_model_len:
                seq.finish("length")
                return []
            params = seq.params.denoising or DenoisingParams()
            self._canvases[seq.seq_id] = Canvas(params, self.canvas_length, self.vocab_size, seq.generator)
            self.num_canvases += 1
            return []
        before, n = planned
        seq.truncate_tokens(before)
        if n < self.canvas_length:  # cut short by the token budget: nothing denoised
            return []
        canvas = self._canvases[seq.seq_id]
        canvas.step(logits)
        self.num_steps += 1
        if not canvas.done:
            return []
        del self._canvases[seq.seq_id]
        self.num_tokens += self.canvas_length
        return canvas.argmax.tolist()

    def settle(self, seqs: list[Sequence]) -> None:
        """The canvas rows' K/V are the decoder's: the computed count falls back before them."""
        for seq in seqs:
            planned = self._planned.pop(seq.seq_id, None)
            if planned is not None and seq.num_computed_tokens > planned[0]:
                seq.rewind(planned[0])
                self.kv.truncate(seq, planned[0])
            if seq.is_finished:
                self.release(seq)

    def release(self, seq: Sequence) -> None:
        self._canvases.pop(seq.seq_id, None)
        self._planned.pop(seq.seq_id, None)

    def stats(self) -> dict[str, Any]:
        if not self.diffusion:
            return {}
        per_forward = self.num_tokens / self.num_steps if self.num_steps else 0.0
        return {"denoising_steps": self.num_steps, "canvases": self.num_canvases,
                "committed_tokens_per_denoising_step": per_forward}

    def annotate(self, outputs: list) -> None:
        return None
