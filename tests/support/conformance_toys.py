"""Tiny backends for the families without first-party ones yet (quant, drafter, MoE) and a
preempting scheduler, each with a deliberately broken twin.

``tests/core/conformance/test_conformance_toys.py`` runs the suite on the correct ones (it must
pass); ``tests/core/conformance/test_conformance_suite.py`` copies this file into a pytester
project and runs the suite on the broken ones (it must fail, saying why).
"""

from __future__ import annotations

from collections import deque

import torch
import torch.nn.functional as F

from lmplug import Capabilities, Drafter, MoEBackend, QuantMethod, Scheduler
from lmplug.api import DraftProposal, ScheduledSeq, SchedulerOutput
from lmplug.interfaces.sequence import SequenceStatus
from lmplug.kit import extras

# -- quant: round-to-nearest int8, one scale per output row ---------------------------------------


class ToyRtnInt8(QuantMethod):
    name = "toy_rtn_int8"
    capabilities = Capabilities()

    def create_weights(self, layer, in_features, out_features, dtype, bias):
        layer.qweight = torch.nn.Parameter(
            torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False
        )
        layer.scales = torch.nn.Parameter(torch.empty(out_features), requires_grad=False)
        layer.bias = (
            torch.nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
            if bias
            else None
        )

    def apply(self, layer, x):
        weight = layer.qweight.to(x.dtype) * layer.scales.to(x.dtype)[:, None]
        return F.linear(x, weight, layer.bias)


class ToyRtnNoScale(ToyRtnInt8):
    """Broken: forgets the scales, so the matmul is off by the scale factor."""

    name = "toy_rtn_no_scale"

    def apply(self, layer, x):
        return F.linear(x, layer.qweight.to(x.dtype), layer.bias)


class ToyRtnWrongNames(ToyRtnInt8):
    """Broken: names its scale tensor differently from the published format."""

    name = "toy_rtn_wrong_names"

    def create_weights(self, layer, in_features, out_features, dtype, bias):
        super().create_weights(layer, in_features, out_features, dtype, bias)
        layer.weight_scale = layer.scales
        del layer.scales


class ToyRtnNative(ToyRtnInt8, extras.NativeProduct):
    """Correct, with a C product for the native decode step: the dequantized weight as one
    float32 run of the ``gguf`` plugin's layer product (any C function of the ABI would do)."""

    name = "toy_rtn_native"

    def process_weights_after_loading(self, layer):
        layer.dense = (layer.qweight.float() * layer.scales.float()[:, None]).contiguous()

    def native_product(self, layer):
        from lmplug_quant import gguf_native

        if not gguf_native.available()[0]:
            return None  # no C compiler here: no native product, the check skips
        return gguf_native.layer_product(gguf_native.load(), [(None, layer.dense)], layer.dense.shape[1],
                                         self.native_bias(layer))

    def native_bias(self, layer):
        return layer.bias


class ToyRtnNativeNoBias(ToyRtnNative):
    """Broken: its native product leaves out the bias that ``apply`` adds."""

    name = "toy_rtn_native_no_bias"

    def native_bias(self, layer):
        return None


def rtn_quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127
    qweight = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return {"qweight": qweight, "scales": scales}


def rtn_dequantize(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return tensors["qweight"].float() * tensors["scales"][:, None]


def rtn_layout(in_features: int, out_features: int) -> dict:
    return {
        "qweight": ((out_features, in_features), torch.int8),
        "scales": ((out_features,), torch.float32),
    }


# -- drafter: propose what followed the last earlier occurrence of the last token ------------------


class ToyNgram(Drafter):
    name = "toy_ngram"
    capabilities = Capabilities()

    def propose(self, seqs, num_tokens):
        return DraftProposal([self.lookup(list(s.token_ids), num_tokens) for s in seqs])

    @staticmethod
    def lookup(tokens: list[int], k: int) -> list[int]:
        for i in range(len(tokens) - 2, -1, -1):
            if tokens[i] == tokens[-1]:
                return tokens[i + 1 : i + 1 + k]
        return []


class ToyNgramOutOfVocab(ToyNgram):
    """Broken: pads every proposal to k tokens with an id past the vocabulary."""

    name = "toy_ngram_oov"

    def propose(self, seqs, num_tokens):
        out = super().propose(seqs, num_tokens)
        return DraftProposal([ids + [10_000] * (num_tokens - len(ids)) for ids in out.token_ids])


class ToyNgramStale(ToyNgram):
    """Broken: caches each sequence's first proposal and never looks at new tokens again."""

    name = "toy_ngram_stale"

    def __init__(self, options):
        super().__init__(options)
        self.cache: dict[int, list[int]] = {}

    def propose(self, seqs, num_tokens):
        return DraftProposal(
            [
                self.cache.setdefault(s.seq_id, self.lookup(list(s.token_ids), num_tokens))
                for s in seqs
            ]
        )


# -- MoE: softmax top-k routing and a loop over experts ---------------------------------------------


class ToyMoE(MoEBackend):
    name = "toy_moe"
    capabilities = Capabilities()

    def route(self, router_logits, top_k, renormalize):
        weights, ids = torch.topk(torch.softmax(router_logits.float(), dim=-1), top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def experts(self, x, expert_ids, weights, w_gate_up, w_down):
        out = torch.zeros_like(x, dtype=torch.float32)
        inter = w_down.shape[2]
        for e in expert_ids.unique().tolist():
            tok, slot = (expert_ids == e).nonzero(as_tuple=True)
            gate, up = (x[tok].float() @ w_gate_up[e].float().T).split(inter, dim=-1)
            y = (F.silu(gate) * up) @ w_down[e].float().T
            out.index_add_(0, tok, y * weights[tok, slot].float()[:, None])
        return out.to(x.dtype)


class ToyMoENoRenormalize(ToyMoE):
    """Broken: ignores ``renormalize``."""

    name = "toy_moe_no_renorm"

    def route(self, router_logits, top_k, renormalize):
        return super().route(router_logits, top_k, False)


# -- scheduler: continuous batching with chunked prefill and preemption by recompute ---------------


class ToyContinuous(Scheduler):
    name = "toy_continuous"
    capabilities = Capabilities(features=frozenset({"preemption", "chunked_prefill"}))

    def __init__(self, options, kv, limits):
        super().__init__(options, kv, limits)
        self.waiting: deque = deque()
        self.running: list = []

    def add(self, seq):
        self.waiting.append(seq)

    def schedule(self):
        out = SchedulerOutput()
        budget = self.limits.max_num_batched_tokens
        for seq in list(self.running):
            if seq not in self.running or budget == 0:
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while (
                not self.kv.can_allocate(seq, seq.num_computed_tokens + n) and seq in self.running
            ):
                out.preempted.append(self.preempt(self.running[-1]))
            if seq in self.running:
                self.kv.allocate(seq, seq.num_computed_tokens + n)
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
        while (
            self.waiting
            and budget
            and len(self.running) < self.limits.max_num_seqs
            and not out.preempted
        ):
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.kv.can_allocate(seq, seq.num_computed_tokens + n):
                break
            self.waiting.popleft()
            self.kv.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def preempt(self, seq):
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0  # recompute everything, generated tokens included
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        return seq

    def update(self, finished):
        for seq in finished:
            self.kv.free(seq)
            self.running.remove(seq)

    def abort(self, request_id):
        dropped = [s for s in [*self.running, *self.waiting] if s.request_id == request_id]
        for seq in dropped:
            self.kv.free(seq)
            seq.status = SequenceStatus.FINISHED
        self.running = [s for s in self.running if s.request_id != request_id]
        self.waiting = deque(s for s in self.waiting if s.request_id != request_id)
        return dropped

    @property
    def num_waiting(self):
        return len(self.waiting)

    @property
    def num_running(self):
        return len(self.running)


class ToyPreemptNoRecompute(ToyContinuous):
    """Broken: frees a preempted sequence's KV but keeps its progress, so it resumes from nothing."""

    name = "toy_preempt_no_recompute"

    def preempt(self, seq):
        computed = seq.num_computed_tokens
        super().preempt(seq)
        seq.num_computed_tokens = computed
        return seq


class ToyOverBudget(ToyContinuous):
    """Broken: admits one token more than the budget allows."""

    name = "toy_over_budget"

    def schedule(self):
        out = super().schedule()
        for item in out.scheduled:
            if (
                item.num_new_tokens > 1
                and item.seq.num_computed_tokens + item.num_new_tokens < item.seq.num_tokens
            ):
                self.kv.allocate(item.seq, item.seq.num_computed_tokens + item.num_new_tokens + 1)
                item.num_new_tokens += 1
                break
        return out
