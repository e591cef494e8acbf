"""The model runner: one forward over the step's flattened tokens, then logits where needed."""

from __future__ import annotations

import contextlib
import itertools
import operator
from collections.abc import Callable

import torch

from lmplug.interfaces.kvcache import KVCacheBackend
from lmplug.interfaces.runner import StepResult
from lmplug.interfaces.scheduler import ScheduledSeq
from lmplug.interfaces.step import StepContext
from lmplug.kit.kv_layout import kv_slots_list
from lmplug.kit.pipeline import PipelineStage, exchange_logits, whole
from lmplug.kit.threads import small_ops_single_threaded

# query tokens x positions each attends, summed over a step: at most this (a 512-token prompt's
# 512 x 512), torch's attention and other ops are a small share of a step beside the products
# (about ctx / (6 x hidden) of them at context ctx), small enough for one thread
SMALL_ATTENTION = 512 * 512


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCacheBackend, device: torch.device,
                 parallel=None, *, short_query_tokens: int = 0, keep_hidden: bool = False,
                 small_step_tokens: int = 0, stage: PipelineStage | None = None) -> None:
        self.model = model
        # pipeline parallel: this process's stage (its layers' K/V and states only; logits travel
        # from the last stage to rank 0)
        self.stage = stage or whole()
        self.parallel = parallel  # rank 0 of a tensor-parallel group (``lmplug.parallel.launch``)
        self.kv = kv
        self.device = device
        # the attention backend's ``short_query_tokens``: the step order puts queries of at most
        # this many tokens before longer ones
        self.short_query_tokens = short_query_tokens
        self.keep_hidden = keep_hidden  # return the final hidden states behind the logits (Medusa)
        # a step of at most this many tokens runs with torch on one thread
        # (``lmplug.kit.threads``: the quant method's products keep their own threads); 0: never
        self.small_step_tokens = small_step_tokens
        self.adapters = None  # the LoRA adapters served (``engine.adapters.Adapters``), set by the build
        self._defer = False  # this step's logits received later (``submit``: a pipeline micro-batch)
        model.bind_kv(self._global([kv.layer_view(i) for i in range(kv.spec.num_layers)],
                                   [self.stage.start + i for i in range(kv.spec.num_layers)]))
        if kv.spec.states:  # state layers read their pools through ``ctx.state_slots``
            model.bind_states(self._global([kv.state_view(i) for i in range(len(kv.spec.states))],
                                           [spec.layer for spec in kv.spec.states]))

    def build_context(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, StepContext]:
        """Flatten the batch (decodes first) into input ids and the per-step record.

        A row with its own ``positions`` and ``mask`` (a speculative draft tree) gets them in
        ``positions`` and ``query_masks``; its K/V slots stay ``start + j``."""
        bs = self.kv.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []  # where each token's K/V goes: start + j through the table (a tree's too)
        query_lens, seq_lens, tables = [], [], []
        query_masks: dict[int, torch.Tensor] = {}
        row_inputs = {b: item.inputs for b, item in enumerate(batch) if item.inputs is not None}
        for b, item in enumerate(batch):
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            table = self.kv.block_table(seq)
            ids.extend(seq.token_ids[start:start + n])
            slots.extend(kv_slots_list(table, range(start, start + n), bs))
            rows, mask = item.positions, item.mask
            if mask is not None:
                if len(rows) != n or tuple(mask.shape) != (n, n):
                    raise RuntimeError(f"runner: sequence {seq.seq_id} schedules {n} tokens but carries "
                                       f"{len(rows)} positions and a {tuple(mask.shape)} mask")
                query_masks[b] = mask.to(self.device)
            positions.extend(range(start, start + n) if rows is None else rows)
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(table)
        width = max(len(t) for t in tables)
        num_decodes = 0
        while (num_decodes < len(batch) and query_lens[num_decodes] == 1
               and seq_lens[num_decodes] > 1):
            num_decodes += 1
        dev = self.device
        ctx = StepContext(
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            query_lens=torch.tensor(query_lens, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            cu_query_lens=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
            num_decodes=num_decodes, query_masks=query_masks, row_inputs=row_inputs,
            state_slots=(torch.tensor([self.kv.state_slot(item.seq) for item in batch], dtype=torch.int32,
                                      device=dev) if self.kv.spec.states else None))
        return torch.tensor(ids, dtype=torch.int64, device=dev), ctx

    def execute(self, batch: list[ScheduledSeq]) -> StepResult:
        """One forward over the batch; with LoRA adapters, one per group of rows whose adapters fit
        the device slots (``Adapters.groups``), their results joined."""
        if self.adapters is not None:
            groups = self.adapters.groups(batch)
            if len(groups) > 1:
                return _joined([self._execute(group) for group in groups])
        return self._execute(batch)

    @torch.inference_mode()
    def _execute(self, batch: list[ScheduledSeq]) -> StepResult:
        return self._submit(batch)()

    @torch.inference_mode()
    def submit(self, batch: list[ScheduledSeq]) -> Callable[[], StepResult]:
        """Pipeline parallel: run the first stage's part of the step and return what finishes it
        (receives the last stage's logits), so that the engine can submit another micro-batch first."""
        return self._submit(batch, defer=True)

    def _submit(self, batch: list[ScheduledSeq], defer: bool = False) -> Callable[[], StepResult]:
        # its callers enter inference mode once for the step (each entry costs microseconds)
        # decodes first (backends take a fast path over ``[:num_decodes]``), then short queries,
        # chains shortest first, then draft trees (a verify of a few drafts, a small chunk: backends
        # may read a leading run of short queries as decode rows), then the long ones
        batch = sorted(batch, key=lambda s: (not (s.num_new_tokens == 1 and s.seq.num_computed_tokens > 0),
                                             s.num_new_tokens > self.short_query_tokens,
                                             s.mask is not None, s.num_new_tokens))
        input_ids, ctx = self.build_context(batch)
        ends = list(itertools.accumulate(ctx.query_lens_cpu))  # cu_query_lens[1:], read on the host
        sample_rows, rows, num_rows = [], [], []
        prompt_rows: dict[int, tuple[int, slice]] = {}
        pool_rows: dict[int, tuple[int, slice]] = {}
        for item, end in zip(batch, ends):
            seq = item.seq
            start = end - item.num_new_tokens
            if seq.pooling is not None:  # an embedding: its hidden states, never the LM head
                pool_rows[seq.seq_id] = (seq.num_computed_tokens, slice(start, end))
                continue
            if seq.wants_prompt_logprobs:
                # logits at prompt positions predict the next prompt token
                prompt_rows[seq.seq_id] = (seq.num_computed_tokens, slice(start, end))
            if seq.num_computed_tokens + item.num_new_tokens == seq.num_tokens:
                n = item.num_logit_rows  # speculative: the drafts are verified from these rows
                sample_rows.append(item)
                rows.extend(range(end - n, end))
                num_rows.append(n)
        groups = [where for _, where in prompt_rows.values()] + ([_as_slice(rows)] if rows else [])
        if self.adapters is not None:  # each token's adapter slot, read by every adapted layer
            self.adapters.set_step([(item.seq.adapter, item.num_new_tokens) for item in batch], self.device)
        self._defer = defer
        try:
            if self.parallel is not None:  # tensor parallel: every rank runs the same step on its shard
                logits, hidden = self.parallel.run_step(self, input_ids, ctx, groups)
            else:
                logits, hidden = self._run(input_ids, ctx, groups)
        finally:
            self._defer = False
            if self.adapters is not None:  # forwards outside a step (a drafter's) run on the base
                self.adapters.clear_step()
        if not callable(logits):
            return lambda: self._result(logits, hidden, sample_rows, rows, num_rows, prompt_rows, pool_rows)
        receive = logits  # pipeline: the last stage's logits, received when the engine collects the step

        @torch.inference_mode()
        def finish() -> StepResult:
            got = self.parallel.finish_step(receive)
            return self._result(got, hidden, sample_rows, rows, num_rows, prompt_rows, pool_rows)

        return finish

    def _result(self, logits, hidden, sample_rows, rows, num_rows, prompt_rows, pool_rows) -> StepResult:
        prompt_logits = {seq_id: (first, lg) for (seq_id, (first, _)), lg in zip(prompt_rows.items(), logits)}
        if pool_rows and hidden is None:
            raise RuntimeError("embeddings are not served under pipeline parallelism "
                               "(parallel.pipeline_parallel_size > 1): the final hidden states stay on the last stage")
        pooled = {seq_id: (first, hidden[where]) for seq_id, (first, where) in pool_rows.items()}
        if not rows:
            return StepResult(sample_rows, None, prompt_logits, num_rows, pooled=pooled)
        return StepResult(sample_rows, logits[-1], prompt_logits, num_rows,
                          hidden[rows] if self.keep_hidden else None, pooled=pooled)

    def threads_for(self, query_lens: list[int], seq_lens: list[int]) -> contextlib.AbstractContextManager:
        """Where the products have threads of their own (``small_step_tokens`` > 0), a step of
        rows with these new tokens and lengths runs with torch on one thread when it has few
        tokens (``small_step_tokens``) or little attention beside its products
        (``SMALL_ATTENTION``): otherwise torch's OpenMP workers spin between its ops on the cores
        the products' threads need. The engine opens it around its whole step (sampling's ops
        over a few rows of logits are as small as the layers' ones); ``run`` opens it for callers
        that run a forward alone (nested, it is the outer one)."""
        if self.small_step_tokens and (sum(query_lens) <= self.small_step_tokens
                                       or sum(map(operator.mul, query_lens, seq_lens)) <= SMALL_ATTENTION):
            return small_ops_single_threaded()
        return contextlib.nullcontext()

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, ctx: StepContext,
            groups: list) -> tuple[list[torch.Tensor | None], torch.Tensor]:
        """The forward over the step's tokens, then logits for each group of rows (a slice or
        a list of row indices). Tensor-parallel workers call it with rank 0's inputs; their
        logits are None (gathered on rank 0)."""
        return self._run(input_ids, ctx, groups)

    def _run(self, input_ids: torch.Tensor, ctx: StepContext,
             groups: list) -> tuple[list[torch.Tensor | None], torch.Tensor]:
        """``run`` inside inference mode already (a step's ``_submit``): entering it again costs microseconds."""
        with self.threads_for(ctx.query_lens_cpu, ctx.seq_lens_cpu):
            return self._forward(input_ids, ctx, groups)

    def _forward(self, input_ids: torch.Tensor, ctx: StepContext,
                 groups: list) -> tuple[list[torch.Tensor | None], torch.Tensor]:
        hidden = self.model(input_ids, ctx.positions, ctx)  # [T, h] (pipeline: the last stage's only)
        if self.stage.split:
            return exchange_logits(self.model.tp, self.model, hidden, groups, input_ids.shape[0],
                                   self.model.config.vocab_size, self.device, defer=self._defer), None
        return [self.model.compute_logits(hidden[where]) for where in groups], hidden

    def _global(self, views: list, layers: list[int]) -> list:
        """Views by model layer: one stage's own at their global indices, None for other stages'."""
        if not self.stage.split or not views:
            return views
        out = [None] * self.model.config.num_layers
        for view, layer in zip(views, layers, strict=True):
            out[layer] = view
        return out



def _as_slice(rows: list[int]) -> slice | list[int]:
    """Increasing rows as a slice where they are consecutive (every decode step's): the hidden
    states' slice is a view where a list of rows is an index op and a copy."""
    return slice(rows[0], rows[-1] + 1) if rows[-1] - rows[0] == len(rows) - 1 else rows


def _joined(results: list[StepResult]) -> StepResult:
    """Step results of disjoint groups of rows as one."""
    logits = [r.logits for r in results if r.logits is not None]
    hidden = [r.hidden for r in results if r.hidden is not None]
    return StepResult([item for r in results for item in r.sample_rows],
                      torch.cat(logits) if logits else None,
                      {k: v for r in results for k, v in r.prompt_logits.items()},
                      [n for r in results for n in r.num_rows],
                      torch.cat(hidden) if hidden else None,
                      pooled={k: v for r in results for k, v in r.pooled.items()})
