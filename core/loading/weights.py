"""Copy checkpoint tensors (HF names) into a built model, checking names and shapes."""

from __future__ import annotations

import logging

import torch

from lmplug.errors import ModelLoadError
from lmplug.loading.source import ModelSource
from lmplug.models.layers import Linear

logger = logging.getLogger(__name__)


def load_weights(model: torch.nn.Module, source: ModelSource, progress=None) -> None:
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    expected = {_key(name, shard, modules): (name, shard) for name, shard in _expected(model, modules)}
    loaded: set[str] = set()
    for name, tensor in source.iter_tensors():
        target = model.weight_target(name)
        if progress is not None:
            progress.update(1)
        if target is None:
            continue
        path, shard = target
        if path not in params:
            logger.warning("%s: tensor %r is not used by this architecture", source.path, name)
            continue
        param = params[path]
        if shard is not None:
            module = modules[path.rpartition(".")[0]]
            start, end = module.shard_range(shard)
            dest = param.data[start:end]
        else:
            dest = param.data
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"{source.path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(dest.shape)}")
        dest.copy_(tensor)
        loaded.add(_key(path, shard, modules))
    missing = sorted(set(expected) - loaded)
    if missing:
        # name what the checkpoint lacks in its own (HF) names, not our fused parameter paths
        describe = getattr(model, "checkpoint_name", None)
        missing = [describe(*expected[k]) if describe else k for k in missing]
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ModelLoadError(f"{source.path}: {len(missing)} tensors missing from the checkpoint: {shown}")
    for module in model.modules():
        if isinstance(module, Linear):
            module.quant.process_weights_after_loading(module)


def _expected(model: torch.nn.Module, modules: dict) -> list[tuple[str, str | None]]:
    out = []
    for name, _ in model.named_parameters():
        owner = modules.get(name.rpartition(".")[0])
        if isinstance(owner, Linear):
            out.extend((name, shard) for shard in owner.shards)
        else:
            out.append((name, None))
    return out


def _key(path: str, shard: str | None, modules: dict) -> str:
    return f"{path}[{shard}]" if shard else path
