"""Every hook lmplug calls, grouped by phase.

Registration hooks run once, when the plugin manager builds its registry;
they return backend *classes*. Lifecycle hooks let plugins observe the
engine. Hot paths never go through a hook call: the engine calls the chosen
backend objects directly.

A plugin is a module (or object) exposed under the entry-point group
``lmplug.plugins``. It must define ``LMPLUG_API_VERSION`` (an int, the core
API major version it targets) and implement any of the hooks below,
decorated with ``lmplug.hookimpl``.
"""

from __future__ import annotations

from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("lmplug")
hookimpl = pluggy.HookimplMarker("lmplug")


# -- registration: called once each when the registry is built ---------------
# One per plugin family; which hook fills which family (and the base class its classes must
# subclass) is the family table, ``lmplug.families.TABLE``.


@hookspec
def lmplug_register_attention_backends() -> list[type]:
    """Return ``AttentionBackend`` subclasses this plugin provides (may be empty)."""


@hookspec
def lmplug_register_kvcache_backends() -> list[type]:
    """Return ``KVCacheBackend`` subclasses this plugin provides."""


@hookspec
def lmplug_register_kvconnectors() -> list[type]:
    """Return ``KVConnector`` subclasses this plugin provides: tiers KV blocks move to and come back
    from (host memory, disk, another engine), chosen by ``kvconnector: {backend: NAME}``."""


@hookspec
def lmplug_register_schedulers() -> list[type]:
    """Return ``Scheduler`` subclasses this plugin provides."""


@hookspec
def lmplug_register_quant_methods() -> list[type]:
    """Return ``QuantMethod`` subclasses this plugin provides."""


@hookspec
def lmplug_register_speculative_methods() -> list[type]:
    """Return ``Drafter`` subclasses this plugin provides: speculative decoding methods, chosen by
    ``speculative: {method: NAME}``."""


@hookspec
def lmplug_register_acceptance_rules() -> list[type]:
    """Return ``AcceptanceRule`` subclasses this plugin provides: how speculative decoding decides
    which draft tokens to keep (chosen by ``speculative: {acceptance: {rule: NAME}}``)."""


@hookspec
def lmplug_register_moe_backends() -> list[type]:
    """Return ``MoEBackend`` subclasses this plugin provides."""


@hookspec
def lmplug_register_mixer_backends() -> list[type]:
    """Return ``MixerBackend`` subclasses this plugin provides: the sequence-mixing ops of
    linear-attention and state-space layers (SSD scan, gated delta rule, lightning attention,
    causal conv1d), chosen by ``mixer: {backend: NAME}`` for models with state layers."""


@hookspec
def lmplug_register_constraint_backends() -> list[type]:
    """Return ``ConstraintBackend`` subclasses this plugin provides: grammar engines for structured
    output (JSON schema, regex, choice, EBNF)."""


@hookspec
def lmplug_register_adapter_backends() -> list[type]:
    """Return ``AdapterBackend`` subclasses (LoRA math over a batch's rows; ``lora:`` section)."""


@hookspec
def lmplug_register_compression_methods() -> list[type]:
    """Return ``Compressor`` subclasses this plugin provides: prompt-compression methods applied
    to a request's prompt before the engine tokenizes it, chosen by ``compression: {method: NAME}``."""


@hookspec
def lmplug_register_quantizers() -> list[type]:
    """Return ``Quantizer`` subclasses this plugin provides: offline methods that write a
    quantized checkpoint (``lmplug quantize MODEL OUT --method NAME``)."""


@hookspec
def lmplug_register_architectures() -> list[type]:
    """Return ``Architecture`` subclasses this plugin provides: model architectures, each serving
    the checkpoints whose ``config.json`` it declares (``model_types`` / ``hf_architectures``), or,
    marked ``fallback``, what no native architecture serves. Chosen by ``model_impl``."""


# -- registration hooks' earlier names: still called, deprecated (pluggy warns their implementers)
# The family table lists them (``old_hooks``); the generated docs name them under the new hook.


@hookspec(warn_on_impl=DeprecationWarning(
    "lmplug_register_drafters is now lmplug_register_speculative_methods"))  # rename_concepts: keep
def lmplug_register_drafters() -> list[type]:  # rename_concepts: keep
    """Deprecated name of ``lmplug_register_speculative_methods`` (same contract)."""


@hookspec(warn_on_impl=DeprecationWarning(
    "lmplug_register_compressors is now lmplug_register_compression_methods"))  # rename_concepts: keep
def lmplug_register_compressors() -> list[type]:  # rename_concepts: keep
    """Deprecated name of ``lmplug_register_compression_methods`` (same contract)."""


# -- lifecycle: observation points ---------------------------------------------


@hookspec
def lmplug_configure(config: Any) -> None:
    """Called once with the validated config, before any backend is built.

    Raising here aborts start-up with the plugin's message.
    """


@hookspec
def lmplug_engine_started(engine: Any) -> None:
    """Called once when an ``LLMEngine`` has built its model and backends. ``engine`` is a
    read-only ``lmplug.api.EngineView`` (config, chosen backends, model facts, context limit,
    last step's statistics), the same object the other lifecycle hooks receive."""


@hookspec
def lmplug_step_finished(engine: Any, stats: dict) -> None:
    """Called after every engine step (``engine``: its ``EngineView``) with that step's statistics
    (``num_running``, ``num_waiting``, ``num_prefill_tokens``,
    ``num_decode_tokens``, ``kv_usage``, ``step_time_s``). Only called when some
    plugin implements it."""


@hookspec
def lmplug_request_finished(engine: Any, output: Any) -> None:
    """Called once per finished request (``engine``: its ``EngineView``) with its final
    ``RequestOutput``."""
