"""lmplug vs HF transformers on the demo model, side by side in one process.

    python benchmarks/bench_vs_hf.py [--model NAME_OR_PATH] [--new-tokens 64] [--repeats 3]

Prints load time, TTFT and batch-1 decode tokens/s for both engines, the
fraction of the memory-bandwidth floor each reaches, and the ratios. For a GGUF
file (the demo model) transformers runs on the same dense weights lmplug reads
(its own GGUF loading keeps them packed and computes in float32), so its load
time is not reported.
"""

import sys

from lmplug.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--model" not in args and "-m" not in args:
        args = ["--model", "smollm2-135m-instruct", *args]
    sys.exit(main(["bench", "--compare-hf", "--dtype", "float32", *args]))
