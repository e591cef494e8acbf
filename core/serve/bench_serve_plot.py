"""``lmplug bench serve --plot``: latency and throughput against load, one line per server.

matplotlib is an optional dependency (``pip install 'lmplug[bench]'`` or ``pip install matplotlib``);
without it ``--plot`` fails before the run with a message naming it.
"""

from __future__ import annotations

import math
from pathlib import Path

from lmplug.errors import ConfigError


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot needs matplotlib, which is not installed: pip install matplotlib "
                          "(or lmplug[bench]); or leave out --plot and use --json") from None


def plot(runs: list[dict], path: Path) -> None:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    by_rate = any(math.isfinite(r["rate"]) for r in runs)
    xlabel = "request rate (req/s)" if by_rate else "concurrency"
    panels = [("ttft", "p50", "TTFT p50 (ms)"), ("tpot", "p50", "TPOT p50 (ms)"), ("e2e", "p99", "E2E p99 (ms)"),
              ("output_throughput", None, "output tokens/s")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4))
    for server in dict.fromkeys(r["server"] for r in runs):
        mine = [r for r in runs if r["server"] == server]
        xs = [r["rate"] if by_rate else (r["concurrency"] or 0) for r in mine]
        for ax, (key, pct, title) in zip(axes, panels):
            ys = [r["summary"][key] if pct is None else r["summary"][key][f"{pct}_ms"] for r in mine]
            ax.plot(xs, ys, marker="o", label=server)
            ax.set_title(title)
            ax.set_xlabel(xlabel)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
