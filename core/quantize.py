"""``lmplug quantize MODEL OUT --method NAME``: the CLI glue around a registered ``Quantizer``.

The core only knows the ``Quantizer`` interface: it opens the model, turns
the flags that were given into the method's options (a flag the method does
not take, or a value it refuses, is an error naming the flag), writes into a
temporary folder beside ``OUT`` and renames it into place when the method
returns, so ``OUT`` is either complete or absent.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from pydantic import ValidationError

from lmplug.errors import ConfigError, PluginError
from lmplug.interfaces.quantizer import CalibrationSpec, Progress

# CLI flag -> option name
FLAGS = {"bits": "--bits", "group_size": "--group-size", "desc_act": "--desc-act", "alpha": "--alpha"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="float model: name in the cache, HF folder, or .gguf file")
    p.add_argument("out", help="output folder (must not exist, or be empty)")
    p.add_argument("--method", required=True, help="quantizer name (see `lmplug plugins`): rtn, gptq, awq, "
                   "smoothquant, fp8, ...")
    p.add_argument("--bits", type=int, help="bits per weight (method default if omitted)")
    p.add_argument("--group-size", type=int, help="input columns per scale (-1: one group per row)")
    p.add_argument("--desc-act", action="store_true", default=None, help="GPTQ act-order")
    p.add_argument("--alpha", type=float, help="SmoothQuant migration strength")
    p.add_argument("--calib-samples", type=int, default=32, help="calibration windows (default 32)")
    p.add_argument("--calib-len", type=int, default=512, help="tokens per calibration window (default 512)")
    p.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                   help="any other option of the method, e.g. percdamp=0.01, clip=false (repeatable)")


def method_options(cls: type, args: argparse.Namespace):
    """The method's ``Options`` from the given flags; errors name the flag."""
    import yaml

    given: dict[str, object] = {}
    where: dict[str, str] = {}
    for key, flag in FLAGS.items():
        value = getattr(args, key, None)
        if value is not None:
            given[key], where[key] = value, flag
    for pair in args.option:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"-o {pair!r}: expected KEY=VALUE")
        given[key], where[key] = yaml.safe_load(raw), f"-o {key}"
    try:
        return cls.Options(**given)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = str(err["loc"][0]) if err["loc"] else "?"
            flag = where.get(key, key)
            if err["type"] == "extra_forbidden":
                problems.append(f"{flag}: method {cls.name!r} does not take this option")
            else:
                problems.append(f"{flag} {given.get(key)!r}: {err['msg']}")
        takes = ", ".join(cls.Options.model_fields)
        raise ConfigError(f"--method {cls.name}: " + "; ".join(problems) + f" (its options: {takes})") from None


def check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"OUT {out}: exists and is not an empty folder; give a new path "
                          "(nothing is overwritten)")


def make_progress() -> Progress:
    """A tqdm bar per stage when tqdm is installed and stderr is a terminal, else a line on
    stderr (when not a terminal, one per finished stage: no ``\\r`` updates in log files)."""
    tty = sys.stderr.isatty()
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    bars: dict[str, object] = {}

    def progress(stage: str, done: int, total: int) -> None:
        if not tty:
            if done >= total:
                print(f"{stage}: {done}/{total}", file=sys.stderr, flush=True)
            return
        if tqdm is not None:
            bar = bars.get(stage)
            if bar is None:
                bar = bars[stage] = tqdm(total=total, desc=stage, file=sys.stderr, leave=True)
            bar.update(done - bar.n)
            if done >= total:
                bar.close()
            return
        end = "\n" if done >= total else ""
        print(f"\r{stage}: {done}/{total}", end=end, file=sys.stderr, flush=True)

    return progress


def run_quantize(args: argparse.Namespace) -> int:
    from lmplug.loading import open_source
    from lmplug.loading.cache import resolve_model
    from lmplug.plugins import get_registry

    try:
        info = get_registry().get("quantizer", args.method)
    except PluginError as exc:
        raise ConfigError(f"--method {args.method!r}: {exc}") from None
    options = method_options(info.cls, args)
    if args.calib_samples < 1 or args.calib_len < 2:
        raise ConfigError(f"--calib-samples {args.calib_samples} / --calib-len {args.calib_len}: need at "
                          "least 1 window of at least 2 tokens")
    out = Path(args.out)
    check_out(out)
    source = open_source(resolve_model(args.model))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; OUT gets the usual permissions
    try:
        summary = info.cls(options).quantize(source, tmp, CalibrationSpec(args.calib_samples, args.calib_len),
                                             make_progress())
        check_out(out)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(json.dumps({"out": str(out), **summary}, indent=2))
    return 0
