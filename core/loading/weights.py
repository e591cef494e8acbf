"""Copy checkpoint tensors (HF names) into a built model, checking names and shapes.

The model maps each checkpoint name to where it goes: ``weight_target(name)``
returns ``(parameter path, shard)`` or ``(parameter path, shard, expert)``
(None: skip the tensor). ``expert`` indexes the leading axis of a stacked
``[E, ...]`` parameter; ``shard`` names a slice of the rows, given by the owning
module's ``shard_range(shard)``; a ``Linear`` hands the tensor to its quant method's
``load_shard``, which knows where packed formats keep their output axis. A module whose parameters are filled piece by
piece lists the pieces of each in ``checkpoint_pieces(param) -> [(shard, expert)]``
(``Linear``: one per shard), so that missing tensors are found and named.
A model may split a checkpoint tensor into several first (``split_tensor``), and a
module may finish its own loading once every ``Linear`` is processed (``after_loading``).
Tensor parallelism (``parallel``): each rank reads only its slice of every split tensor
(``lmplug.kit.sharding.rank_piece``; lazily from safetensors), then loads it as above.
Packed weights (GGUF blocks, ``PackedTensor``): when a ``Linear``'s quant method takes them
(``lmplug.kit.extras.PackedWeights``), the checkpoint is read through ``ModelSource.iter_packed`` and
those layers get the blocks as they are; every other parameter gets them dequantized. A model
with a ``split_tensor`` is read packed only when it says its split takes them (``PACKED_SPLIT``).
"""

from __future__ import annotations

import logging

import torch

from lmplug.errors import ModelLoadError
from lmplug.interfaces.checkpoint import ModelSource
from lmplug.interfaces.packed import PackedTensor
from lmplug.kit import extras
from lmplug.kit.layers import Linear, bind_quant_methods
from lmplug.loading.pooling_config import headless

logger = logging.getLogger(__name__)


def load_weights(model: torch.nn.Module, source: ModelSource, progress=None, parallel=None) -> None:
    bind_quant_methods(model)  # per-layer quant choices (e.g. ignore lists) before names are fixed
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    expected = {_key(*piece): piece for piece in _expected(model, modules)}
    loaded: set[str] = set()
    split = parallel is not None and parallel.is_parallel
    packed = not split and source.iter_packed is not None and _takes_packed(model)
    prefix = _base_prefix(model, source)
    # pipeline parallel: another stage's layers are skipped before the model maps their names
    foreign = getattr(model, "skips_tensor", None) if parallel is not None and parallel.stage.split else None
    for name, tensor in _tensors(model, source, progress, lazy=split, packed=packed):
        if prefix and not name.startswith(prefix):
            name = prefix + name
        if foreign is not None and foreign(name):
            continue
        target = model.weight_target(name)
        if target is None:
            continue
        path, shard, expert = (*target, None) if len(target) == 2 else target
        if path not in params:
            if parallel is not None and parallel.stage.split:
                continue  # another pipeline stage's layer, embedding or head: never read here
            logger.warning("%s: tensor %r is not used by this architecture", source.path, name)
            continue
        owner_path, _, param_name = path.rpartition(".")
        owner = modules.get(owner_path)
        try:
            if split:
                from lmplug.kit.sharding import rank_piece
                tensor = rank_piece(model, path, owner, param_name, shard, tensor)
            linear = isinstance(owner, Linear) and shard is not None and expert is None
            takes_packed = linear and extras.takes_packed(owner.quant, params[path].device)
            if isinstance(tensor, PackedTensor) and not takes_packed:
                tensor = tensor.dequantize()  # checks the block sizes first
            check_tensor(params[path], tensor)
            if linear:
                start, end = owner.shard_range(shard)
                owner.quant.load_shard(owner, param_name, tensor, start, end - start)
            else:
                _copy_piece(params[path].data, tensor, owner, shard, expert)
        except ValueError as exc:
            raise ModelLoadError(f"{source.path}: tensor {name!r} {exc}") from None
        loaded.add(_key(path, shard, expert))
    missing = sorted(set(expected) - loaded)
    if missing:
        # name what the checkpoint lacks in its own (HF) names, not our fused parameter paths
        describe = getattr(model, "checkpoint_name", None)
        missing = [_describe(describe, *expected[k]) if describe else k for k in missing]
        if prefix:  # a headless checkpoint has no LM head: the engine refuses to generate with it
            missing = [m for m in missing if not m.startswith("lm_head.")]
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ModelLoadError(f"{source.path}: {len(missing)} tensors missing from the checkpoint: {shown}")
    for module in model.modules():
        if isinstance(module, Linear):
            module.quant.process_weights_after_loading(module)
    for module in list(model.modules()):  # e.g. MoE blocks stack their processed experts
        if callable(getattr(module, "after_loading", None)):
            module.after_loading()


def _base_prefix(model: torch.nn.Module, source: ModelSource) -> str:
    """A headless checkpoint (``pooling_config.headless``) names its tensors without the causal
    LM's base-model prefix (``layers.0...`` for ``model.layers.0...``): the prefix they get back."""
    if not headless(source.hf_config):
        return ""
    return getattr(model, "base_model_prefix", "model") + "."


_CHECKED_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(dest: torch.Tensor, tensor) -> None:
    """Refuse integer data for a floating parameter (a quant method that stores packed integers
    creates integer parameters, which take them) and NaN/inf weights: one pass per tensor.
    Packed blocks (``PackedTensor``): their byte size must match their shape and type (the
    values are not read: that would page in the whole file)."""
    if isinstance(tensor, PackedTensor):
        tensor.check()
        return
    if not isinstance(tensor, torch.Tensor):
        return
    if dest.is_floating_point() and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"has integer type {tensor.dtype}, but the model's parameter is {dest.dtype} "
                         "(an integer tensor where a float weight belongs)")
    # a NaN or inf makes the sum non-finite, so one reduction clears almost every tensor; the
    # exact (slower) pass runs only when the sum is not finite (NaN/inf, or a float32 overflow)
    if tensor.dtype in _CHECKED_FLOATS and not bool(torch.isfinite(tensor.sum(dtype=_acc(tensor))))\
            and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise ValueError(f"holds {bad} NaN or infinite values")


def _acc(tensor: torch.Tensor) -> torch.dtype:
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def _takes_packed(model: torch.nn.Module) -> bool:
    """Whether some ``Linear`` takes packed blocks (and no ``split_tensor`` needs dense ones: a
    model whose ``split_tensor`` takes ``PackedTensor`` says so, ``PACKED_SPLIT``)."""
    if getattr(model, "split_tensor", None) is not None and not getattr(model, "PACKED_SPLIT", False):
        return False
    return any(isinstance(m, Linear) and extras.takes_packed(m.quant, _device(m)) for m in model.modules())


def _device(module: torch.nn.Module) -> torch.device:
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def _tensors(model: torch.nn.Module, source: ModelSource, progress, lazy: bool = False,
             packed: bool = False):
    """The checkpoint's tensors (``packed``: weights as ``PackedTensor``), each through the
    model's ``split_tensor(name, tensor) -> [(name, tensor)]`` if it has one (MoE:
    transformers-5 stacked experts -> one tensor per expert)."""
    split = getattr(model, "split_tensor", None)
    # lazy: safetensors slices that read only what is indexed (tensor-parallel ranks); a model
    # whose ``split_tensor`` takes them says so (``LAZY_SPLIT``)
    lazy = (lazy and (split is None or getattr(model, "LAZY_SPLIT", False))
            and source.iter_slices is not None)
    items = source.iter_packed() if packed else source.iter_slices() if lazy else source.iter_tensors()
    for name, tensor in items:
        if progress is not None:
            progress.update(1)
        if split is None:
            yield name, tensor
            continue
        try:
            pieces = split(name, tensor)
        except ValueError as exc:
            raise ModelLoadError(f"{source.path}: tensor {name!r} {exc}") from None
        yield from pieces


def _copy_piece(dest: torch.Tensor, tensor: torch.Tensor, owner, shard: str | None,
                expert: int | None) -> None:
    """Unquantized parameters outside ``Linear``: a stacked expert and/or a slice of rows."""
    if expert is not None:
        dest = dest[expert]  # stacked experts: [E, ...] -> [...]
    if shard is not None:
        start, end = owner.shard_range(shard)
        dest = dest[start:end]
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ValueError(f"has shape {tuple(tensor.shape)}, the model expects {tuple(dest.shape)}")
    dest.copy_(tensor)


def _expected(model: torch.nn.Module, modules: dict) -> list[tuple[str, str | None, int | None]]:
    """Every (parameter path, shard, expert) the checkpoint must fill."""
    out = []
    for name, _ in model.named_parameters():
        owner_path, _, param = name.rpartition(".")
        owner = modules.get(owner_path)
        if isinstance(owner, Linear):
            out.extend((name, shard, None) for shard in owner.shards)
        elif hasattr(owner, "checkpoint_pieces"):
            out.extend((name, shard, expert) for shard, expert in owner.checkpoint_pieces(param))
        else:
            out.append((name, None, None))
    return out


def _key(path: str, shard: str | None, expert: int | None) -> str:
    return path + (f"[{expert}]" if expert is not None else "") + (f"[{shard}]" if shard else "")


def _describe(describe, path: str, shard: str | None, expert: int | None) -> str:
    return describe(path, shard) if expert is None else describe(path, shard, expert)
