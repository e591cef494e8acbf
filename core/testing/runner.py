"""Run the conformance suite on one installed backend without writing a test file.

    python -m lmplug.testing attention chunked -o chunk_size=16
    python -m lmplug.testing kvcache paged -o num_blocks=48 -o block_size=4 -- -x
    python -m lmplug.testing attention flash --device cuda

writes the test class an author would write into a temporary folder, runs
pytest on it and prints a pass/fail table per check, then the first line of
each failure. The exit status is pytest's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import yaml

# family -> the conformance class; quant is absent: its checks need the format hooks
RUNNABLE = {
    "attention": "AttentionConformance",
    "kvcache": "KVCacheConformance",
    "scheduler": "SchedulerConformance",
    "speculative": "DrafterConformance",
    "moe": "MoEConformance",
    "constraint": "ConstraintConformance",
    "acceptance": "AcceptanceConformance",
    "mixer": "MixerConformance",
    "kvconnector": "KVConnectorConformance",
    "adapter": "AdapterConformance",
    "model": "ArchitectureConformance",
}


class TableReport:
    """A pytest plugin object that tallies outcomes per check (test function, parameters dropped)."""

    def __init__(self) -> None:
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self.failures: list[tuple[str, str]] = []

    def pytest_runtest_logreport(self, report) -> None:
        # one outcome per test: its call, or its setup when that failed or skipped
        if not (report.when == "call" or (report.when == "setup" and not report.passed)):
            return
        outcome = "xfailed" if report.skipped and hasattr(report, "wasxfail") else report.outcome
        self.counts[report.nodeid.split("::")[-1].split("[")[0]][outcome] += 1
        if report.failed:
            first = str(report.longrepr).strip().splitlines()
            self.failures.append((report.nodeid.split("::", 1)[-1], first[0] if first else ""))

    def render(self) -> str:
        cols = ("passed", "failed", "skipped", "xfailed")
        width = max([len("check")] + [len(c) for c in self.counts])
        lines = [f"{'check':<{width}}  " + "  ".join(f"{c:>7}" for c in cols)]
        for check, counts in self.counts.items():
            lines.append(f"{check:<{width}}  " + "  ".join(f"{counts[c]:>7}" for c in cols))
        for nodeid, message in self.failures[:20]:
            lines.append(f"FAILED {nodeid}: {message}")
        if len(self.failures) > 20:
            lines.append(f"... and {len(self.failures) - 20} more failures")
        return "\n".join(lines)


DEVICES = ("cpu", "cuda")


def suite_module(family: str, backend: str, options: dict, device: str = "cpu",
                 hf_configs: dict | None = None) -> str:
    cls = RUNNABLE[family]
    name = "".join(part.capitalize() for part in backend.replace("-", "_").split("_")) or "Backend"
    if family == "model":  # the architecture kit: tiny transformers models of these configs
        return (f"from lmplug.testing import {cls}\n\n\n"
                f"class Test{name}({cls}):\n"
                f"    backend = {backend!r}\n"
                f"    configs = {hf_configs!r}\n")
    return (
        f"from lmplug.testing import {cls}\n\n\n"
        f"class Test{name}({cls}):\n"
        f"    backend = {backend!r}\n"
        f"    options = {options!r}\n"
        f"    device = {device!r}\n"
    )


def device_problem(device: str) -> str | None:
    """One line saying why the suite cannot run on ``device``, or None. Checked before pytest
    starts, so that a missing GPU is one clear error rather than every check skipped."""
    if device not in DEVICES:
        return f"--device {device!r}: expected one of {', '.join(DEVICES)}"
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "--device cuda: no CUDA GPU is visible (torch.cuda.is_available() is false)"
    return None


def parse_options(pairs: list[str]) -> dict:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(
                f"option {pair!r}: expected KEY=VALUE (VALUE read as YAML, e.g. 16, true, [1, 2])"
            )
        options[key] = yaml.safe_load(value)
    return options


def options_problem(info, options: dict) -> str | None:
    """One line saying what is wrong with ``-o`` options for this backend, or None."""
    from pydantic import ValidationError

    try:
        info.cls.Options(**options)
    except ValidationError as exc:
        allowed = ", ".join(info.cls.Options.model_fields) or "none"
        problems = "; ".join(
            f"-o {'.'.join(map(str, e['loc'])) or '?'}: "
            + ("unknown option" if e["type"] == "extra_forbidden" else f"{e['msg']} (got {e.get('input')!r})")
            for e in exc.errors())
        return f"{info.family} backend {info.name!r}: {problems} (its options: {allowed})"
    return None


def check(family: str, backend: str, options: dict, pytest_args: list[str], device: str = "cpu",
          hf_configs: list[str] | None = None) -> int:
    """Run the suite for one backend on ``device``; print the table; return pytest's exit status.
    ``hf_configs``: config.json files for the ``model`` family (default: the kit's tiny config
    of the architecture's first model type)."""
    import pytest

    from lmplug.families import canonical

    family = canonical(family)
    if family not in RUNNABLE:
        hint = (
            "quant methods need the format hooks (checkpoint_tensors, quantize, dequantize): "
            "write a QuantConformance subclass"
            if family == "quant"
            else f"families: {', '.join(RUNNABLE)}"
        )
        print(f"cannot check a {family!r} backend from the command line; {hint}", file=sys.stderr)
        return 4
    from lmplug.plugins import get_registry

    try:
        info = get_registry().get(family, backend)
    except Exception as exc:  # noqa: BLE001 - PluginError names what is available
        print(exc, file=sys.stderr)
        return 4
    configs, problem = None, None
    if family == "model":
        from lmplug.testing.architecture import kit_configs

        configs, problem = kit_configs(info.cls, hf_configs or [])
    problem = problem or device_problem(device) or options_problem(info, options)
    if problem:  # once, here, not once per check that builds the backend
        print(problem, file=sys.stderr)
        return 4
    table = TableReport()
    with tempfile.TemporaryDirectory(prefix="lmplug-check-") as tmp:
        path = Path(tmp) / f"test_{family}_{backend.replace('-', '_')}.py"
        path.write_text(suite_module(family, backend, options, device, configs))
        status = pytest.main(
            [str(path), "-q", "-p", "no:cacheprovider", "--rootdir", tmp, *pytest_args],
            plugins=[table],
        )
    print()
    print(
        f"lmplug conformance: {family} backend {backend!r}"
        + (f" on {device}" if device != "cpu" else "")
        + (f" with options {options}" if options else "")
    )
    print(table.render())
    return int(status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lmplug.testing",
        description="Run the lmplug conformance suite on one installed backend.",
    )
    parser.add_argument("family", choices=sorted([*RUNNABLE, "quant"]))
    parser.add_argument("backend", help="the registered backend name (see `lmplug plugins`)")
    parser.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a backend option (repeatable), as in the YAML section",
    )
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help="where the backend runs (default: cpu; cuda: compiled kernels on a GPU)")
    argv = sys.argv[1:] if argv is None else argv
    ours, extra = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    args = parser.parse_args(ours)
    return check(args.family, args.backend, parse_options(args.option), extra, args.device)
