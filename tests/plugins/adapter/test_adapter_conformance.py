"""The first-party LoRA backends against the family's conformance suite."""

from lmplug.testing import AdapterConformance


class TestTorchLoRA(AdapterConformance):
    backend = "torch"


class TestTritonLoRA(AdapterConformance):
    """Under ``TRITON_INTERPRET=1`` on the CPU (the bf16 cases on GPUs only: the interpreter's bf16
    tl.dot is wrong), on CUDA where there is one."""

    backend = "triton"
    skip_bf16_under_triton_interpreter = True
