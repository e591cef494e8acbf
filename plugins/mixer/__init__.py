"""First-party mixer backends: the ops of state layers (SSD scans, causal conv1d, gated delta rule,
lightning attention), in PyTorch (the reference) and Triton. Registered through the
``lmplug.plugins`` entry point."""

from lmplug.api import hookimpl

LMPLUG_API_VERSION = 3


@hookimpl
def lmplug_register_mixer_backends() -> list[type]:
    from lmplug_mixer.mixers import TorchMixer, TritonMixer

    return [TorchMixer, TritonMixer]
