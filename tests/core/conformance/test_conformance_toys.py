"""The conformance suite's quant, drafter and MoE classes (and the preemption checks of the
scheduler class) on the tiny correct backends of ``conformance_toys``: they must pass.

No first-party backend of those families exists yet; these show each check running.
"""

from __future__ import annotations

from support import conformance_toys as toys

from lmplug.testing import (
    DrafterConformance,
    MoEConformance,
    QuantConformance,
    SchedulerConformance,
)


class TestToyRtnInt8(QuantConformance):
    backend_cls = toys.ToyRtnInt8
    max_weight_error = 0.01

    def checkpoint_tensors(self, in_features, out_features):
        return toys.rtn_layout(in_features, out_features)

    def quantize(self, weight):
        return toys.rtn_quantize(weight)

    def dequantize(self, tensors):
        return toys.rtn_dequantize(tensors)


class TestToyRtnNative(TestToyRtnInt8):
    backend_cls = toys.ToyRtnNative


class TestToyNgram(DrafterConformance):
    backend_cls = toys.ToyNgram


class TestToyMoE(MoEConformance):
    backend_cls = toys.ToyMoE


class TestToyContinuous(SchedulerConformance):
    backend_cls = toys.ToyContinuous
