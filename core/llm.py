"""``LLM``: the Python API, shaped like the ones users know (vLLM's ``LLM.generate``)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Self

from lmplug.beam.api import BeamSearchOutput, BeamSearchParams, to_beam_output
from lmplug.compression import PromptCompressor
from lmplug.config import EngineConfig, resolve
from lmplug.engine.build import pick_device, pick_dtype
from lmplug.engine.engine import LLMEngine
from lmplug.errors import ConfigError
from lmplug.interfaces.adapter import LoRARequest
from lmplug.interfaces.compressor import CompressionParams, CompressionReport
from lmplug.interfaces.params import SamplingParams
from lmplug.outputs import EmbeddingRequestOutput, PoolingParams, RequestOutput

Prompt = str | Sequence[int] | dict
# CompressionParams or a dict of its fields; None: the config's `compression` section (if any);
# True: that section explicitly; False: none even if the config has one
Compression = CompressionParams | dict | bool | None


def _check_device(device: str, source: str) -> None:
    """``device: cuda`` on a machine without CUDA is a config error, not torch's AssertionError."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        why = "this torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise ConfigError(f"{source}: device: 'cuda' requested, but {why}; use device: cpu (or auto)")


class LLM:
    """Load a model and generate.

    ``LLM("smollm2-135m-instruct", dtype="float32")`` starts from the embedded
    default config with overrides; ``LLM(config="my.yaml")`` or
    ``LLM(config=EngineConfig(...))`` takes a whole config.

    >>> llm = LLM("smollm2-135m-instruct")                       # doctest: +SKIP
    >>> llm.generate("The capital of France is", SamplingParams(temperature=0))[0].text  # doctest: +SKIP
    """

    def __init__(self, model: str | None = None, *, config: str | Path | EngineConfig | dict | None = None,
                 **overrides: Any) -> None:
        if model is not None:
            overrides["model"] = model
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):  # vLLM's keywords
            if key in overrides:
                overrides["parallel"] = {**(overrides.get("parallel") or {}), key: overrides.pop(key)}
        lora_keys = [k for k in ("max_loras", "max_lora_rank", "max_cpu_loras") if k in overrides]
        if overrides.pop("enable_lora", False) or lora_keys:  # vLLM's keywords for the lora: section
            overrides["lora"] = {**(overrides.get("lora") or {}), **{k: overrides.pop(k) for k in lora_keys}}
        if isinstance(config, EngineConfig):
            cfg = EngineConfig.from_dict({**config.model_dump(), **overrides})
            source = "config"
        elif isinstance(config, dict):
            cfg, source = EngineConfig.from_dict({**config, **overrides}), "config"
        elif config is not None:
            cfg, source = EngineConfig.from_yaml(config, **overrides), str(config)
        else:
            cfg, source = EngineConfig.default(**overrides), "default config"
        device = pick_device(cfg.device)
        _check_device(device, source)
        resolved = resolve(cfg, device=device, dtype=pick_dtype(cfg.dtype, device), source=source)
        self.engine = LLMEngine(resolved)
        self.compressor = PromptCompressor(self.engine)
        self._ids = itertools.count()

    def close(self) -> None:
        """Release the engine's worker processes (tensor parallelism) and flush a KV connector's
        pending writes."""
        self.engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 *, use_tqdm: bool = False, compression: Compression = None,
                 lora: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of ``prompts``.

        A prompt is a string, a list of token ids, or ``{"prompt_token_ids": [...]}``.
        ``compression`` shortens text prompts first (``docs/compression.md``); each output's
        ``compression`` then reports the prompt tokens before and after. ``lora``: the LoRA adapter
        every prompt runs with, or one per prompt (None: the base model); the engine needs a
        ``lora:`` section.
        """
        prompts = self._as_list(prompts)
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ConfigError(f"got {len(prompts)} prompts but {len(params_list)} SamplingParams")
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        if len(loras) != len(prompts):
            raise ConfigError(f"got {len(prompts)} prompts but {len(loras)} LoRA requests")
        prompts, reports = self._compress(prompts, compression)
        return self._run(prompts, params_list, reports, loras)

    def embed(self, prompts: Prompt | list[Prompt], pooling_params: PoolingParams | None = None,
              ) -> list[EmbeddingRequestOutput]:
        """One pooled final hidden state per prompt (vLLM's ``LLM.embed``: ``out.outputs.embedding``).
        ``pooling_params`` fields left None take the config's ``pooler`` section, else the
        checkpoint's sentence-transformers modules, else last token, normalized; ``dimensions``
        truncates (Matryoshka checkpoints). The LM head never runs for these prompts."""
        prompts = self._as_list(prompts)
        if not prompts:
            raise ConfigError("embed: prompts is empty; give at least one text or list of token ids")
        pooling = pooling_params or PoolingParams()
        ids = [self._add(p, SamplingParams(), pooling) for p in prompts]
        return self._collect(ids)

    def beam_search(self, prompts: Prompt | list[Prompt], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search over each prompt (vLLM's ``LLM.beam_search``); ``docs/beam_search.md``."""
        if not isinstance(params, BeamSearchParams):
            raise ConfigError(f"beam_search: params must be a BeamSearchParams, got {type(params).__name__}")
        prompts = self._as_list(prompts)
        outs = self._run(prompts, [params.sampling_params()] * len(prompts), [None] * len(prompts))
        return [to_beam_output(out) for out in outs]

    def _run(self, prompts: list, params_list: list[SamplingParams],
             reports: list[CompressionReport | None], loras: list | None = None) -> list[RequestOutput]:
        ids = [self._add(p, sp, lora=lr) for p, sp, lr in zip(prompts, params_list, loras or [None] * len(prompts))]
        outputs = self._collect(ids)
        for out, report in zip(outputs, reports):
            out.compression = report
        return outputs

    def _collect(self, ids: list[str]) -> list:
        """Step until every request in ``ids`` finished; their outputs in that order."""
        done: dict[str, Any] = {}
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return [done[rid] for rid in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, *,
               compression: Compression = None, lora: LoRARequest | None = None) -> Iterator[RequestOutput]:
        """Yield outputs as tokens arrive; each has ``delta_text`` / ``delta_token_ids``."""
        (prompt,), (report,) = self._compress([prompt], compression)
        rid = self._add(prompt, params or SamplingParams(), lora=lora)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        out.compression = report
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(rid)

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None, *,
             compression: Compression = None, **template_kwargs: Any) -> list[RequestOutput]:
        """Apply the model's chat template and generate; one conversation or a list of them.
        ``compression`` shortens message contents (system messages, the last paragraph of the
        last user message and the template's markup are kept) before the template is applied."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        reports: list[CompressionReport | None] = [None] * len(convs)
        if self._compressing(compression):
            cparams = None if isinstance(compression, bool) else CompressionParams.coerce(compression)
            pairs = [self.compressor.compress_messages(c, cparams, **template_kwargs) for c in convs]
            convs, reports = [c for c, _ in pairs], [r for _, r in pairs]
        prompts = [self.apply_chat_template(c, **template_kwargs) for c in convs]
        params_list = [params or SamplingParams()] * len(prompts)
        return self._run(prompts, params_list, reports)

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> list[int]:
        if self.tokenizer is None:
            raise ConfigError("this model has no tokenizer, so it has no chat template")
        # the template writes the special tokens (BOS included); those in messages stay text
        return self.tokenizer.chat_ids(messages, add_generation_prompt=True, **kwargs)

    def _compressing(self, compression: Compression) -> bool:
        if compression is None:
            return self.compressor.enabled_by_default
        return compression is not False

    def _compress(self, prompts: list, compression: Compression) -> tuple[list, list[CompressionReport | None]]:
        """Text prompts compressed (token-id prompts only with the config's default: left as they
        are, since there is no text to compress), and one report per prompt."""
        reports: list[CompressionReport | None] = [None] * len(prompts)
        if not self._compressing(compression):
            return prompts, reports
        cparams = None if isinstance(compression, bool) else CompressionParams.coerce(compression)
        out = list(prompts)
        for k, prompt in enumerate(prompts):
            text = prompt.get("prompt") if isinstance(prompt, dict) and "prompt_token_ids" not in prompt else prompt
            if not isinstance(text, str):
                if compression is None:
                    continue
                raise ConfigError("compression: needs a text prompt (got token ids); pass the text, or "
                                  "compression=False")
            out[k], reports[k] = self.compressor.compress_text(text, cparams)
        return out, reports

    def _as_list(self, prompts) -> list:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if prompts and isinstance(prompts[0], int):
            return [prompts]
        return list(prompts)

    def _add(self, prompt: Prompt, params: SamplingParams, pooling: PoolingParams | None = None,
             lora: LoRARequest | None = None) -> str:
        rid = str(next(self._ids))
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ConfigError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        self.engine.add_request(rid, prompt, params, pooling=pooling, lora=lora)
        return rid
