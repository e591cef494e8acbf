"""The building kit: the layers an architecture plugin is made of (``lmplug.kit``).

Plugins may import the kit beside the API (``lmplug.api``, ``lmplug.errors``); import-linter
holds that nothing else of the core is reachable from a plugin, and that the kit imports only
the API's modules. Nothing in the API requires the kit. The kit is versioned on its own terms
(``KIT_VERSION``, see docs/plugins.md): a name may change in a minor core release, and the
change is listed in the porting table.

Modules (each imported on its own, so a plugin pays only for what it uses):

- ``decoder``: ``Attention`` (q/k/v projections, RoPE, the chosen attention backend and KV view),
  ``MLP`` (gated, SiLU), ``DecoderLayer`` (pre-norm) and ``DecoderForCausalLM``, the standard
  decoder an architecture subclasses (``make_attention``, ``make_mlp``, ``new_layer``, checkpoint
  names, the native CPU decode step).
- ``layers``: ``Linear`` (through the chosen quant method; stacked shards such as ``qkv_proj``),
  ``RMSNorm``, ``apply_rope``, ``silu_and_mul``, ``gelu_tanh_and_mul``, ``bind_quant_methods``.
- ``parallel_layers``: ``column_linear``, ``row_linear``, ``embedding`` — the tensor-parallel
  layout of a layer; ``parallel``: ``ParallelState`` (rank, world, collectives), ``single``;
  ``sharding``: which slice of a checkpoint tensor a rank reads.
- ``moe``: ``SparseMoeBlock`` (router, stacked experts, shared expert) over the moe backend.
- ``state_layers``: the rows of a state layer (Mamba, linear attention) inside a step.
- ``packed_embedding``: an embedding over a quant method's packed table (GGUF).
- ``mtp``: multi-token-prediction modules built as the target's layer after its last one.
- ``native_step``, ``fused_cpu``: the native CPU decode step (a layer's ``native_form`` describes
  it as a ``LayerForm``; ``NativeDecodeStep.for_layers``: a plan of a drafter's own layers) and
  fused CPU ops; ``native_dense``: the step's C product for the core's float32 weights (and
  ``stacked``: over a copy of separate weights).

Helpers backends of every family share:

- ``sampling``: ``processed_logits``, ``sample``, ``draw``, ``top_logprobs`` and speculative
  sampling's ``rejection_sample``; ``penalties``: ``adjust_logits`` (penalties, ``logit_bias``,
  ``min_tokens``, the constraint's bitmask).
- ``rope``: ``RotaryEmbedding``; ``kv_layout``: ``kv_slots``, the one slot-address formula;
  ``kv_quant``: quantized KV (``store_kv``, ``dequantize_kv``); ``draft_tree``: tree shapes.
- ``devices``: the GPU capability kernels pick launch tables by; ``native_build``: a C library
  built and cached on first use; ``hugemem``: weights in transparent huge pages; ``file_pages``:
  a file mapping's pages given back once copied; ``native``: the native decode step's C ABI; ``threads``:
  compute threads and torch on one thread; ``paths``: the cache folder.
- ``extras``: the opt-in mixins of the first-party fast paths (packed weights, own threads,
  native products and decode, short queries) the core asks only backends that list them.
- ``kv_extras``: the opt-in mixins of a KV cache beyond its interface (forks, swap space, a
  connector's tier, tensor-parallel copies, state slots, a sized pool, prefix sharing).
"""

KIT_VERSION = 1

__all__ = ["KIT_VERSION"]
