"""``auto``'s order does not depend on ``TRITON_INTERPRET``: the Triton backends run on a CPU
under the interpreter only when named (``Capabilities.named_devices``), with the priority
they have on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import json
from lmplug.config import EngineConfig, resolve
from lmplug_attention.flash.backend import FlashAttention
from lmplug_mixer.mixers import TritonMixer

config = EngineConfig.from_dict({"model": "m", "attention": "auto", "kvcache": "paged", "mixer": "auto"})
chosen = {s: b.name for s, b in resolve(config, device="cpu", dtype="float32").backends.items()}
named = EngineConfig.from_dict({"model": "m", "attention": "flash", "kvcache": "paged"})
try:
    resolve(named, device="cpu", dtype="float32")
    flash_named_on_cpu = True
except Exception:
    flash_named_on_cpu = False
caps = {c.name: [sorted(c.capabilities.devices), c.capabilities.priority]
        for c in (FlashAttention, TritonMixer)}
print(json.dumps({"chosen": chosen, "caps": caps, "flash_named_on_cpu": flash_named_on_cpu}))
"""


def _probe(interpret: str) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": interpret}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_auto_chooses_the_same_with_and_without_the_interpreter():
    interpreted, compiled = _probe("1"), _probe("0")
    assert interpreted["chosen"] == compiled["chosen"]
    assert interpreted["chosen"]["attention"] == "paged"  # paged KV on a CPU: paged attention
    assert interpreted["caps"] == compiled["caps"] == {"flash": [["cuda"], 30], "triton": [["cuda"], 30]}
    # under the interpreter flash may still be named on a CPU (the kernel tests); without, not
    assert interpreted["flash_named_on_cpu"] and not compiled["flash_named_on_cpu"]
