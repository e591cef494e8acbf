"""Count a tier's public names: declared in ``__all__``, defined in its modules, used by plugins.

The closing figures of the two-tier contract (issue 37) come from this one command, before and
after: ``python tools/contract_names.py lmplug.interfaces lmplug.api lmplug.kit``. Read with
``ast`` (nothing is imported), so it runs on any checkout.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = ROOT / "plugins"


def tier_files(tier: str) -> dict[str, Path]:
    """The tier's modules by dotted name (a package: every module in it; a module: itself)."""
    rel = tier.split(".", 1)[1].replace(".", "/") if "." in tier else ""
    base = ROOT / "core" / rel
    if base.is_dir():
        return {
            f"{tier}.{p.stem}" if p.stem != "__init__" else tier: p
            for p in sorted(base.glob("*.py"))
        }
    if base.with_suffix(".py").is_file():
        return {tier: base.with_suffix(".py")}
    return {}


def declared(tree: ast.Module) -> list[str]:
    """The names in a module's ``__all__`` (a literal list or tuple)."""
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
    return []


def defined(tree: ast.Module) -> set[str]:
    """Public names a module defines itself (classes, functions, assignments; not imports)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if not n.startswith("_")}


def used_by_plugins(tier: str) -> set[tuple[str, str]]:
    """(module, name) pairs the first-party plugins import from the tier."""
    used: set[tuple[str, str]] = set()
    for path in PLUGINS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module == tier or node.module.startswith(tier + "."):
                    used.update((node.module, a.name) for a in node.names)
    return used


def report(tier: str) -> None:
    files = tier_files(tier)
    if not files:
        print(f"{tier}: no such tier")
        return
    trees = {mod: ast.parse(p.read_text()) for mod, p in files.items()}
    top = trees.get(tier)
    all_names = declared(top) if top is not None else []
    defs = {(m, n) for m, t in trees.items() for n in defined(t)}
    used = used_by_plugins(tier)
    outside = {(m, n) for m, n in used if n not in all_names}
    no_interface = sum(1 for m, t in trees.items() if m != tier and not any(
        isinstance(n, ast.ClassDef) and any(
            isinstance(b, ast.Name) and b.id in ("ABC", "Protocol") for b in n.bases)
        for n in t.body))
    print(f"{tier}: {len(files)} modules ({no_interface} without an ABC or Protocol)")
    print(f"  declared in __all__: {len(all_names)}")
    print(f"  defined (public, in its modules): {len(defs)}")
    print(f"  imported by first-party plugins: {len({n for _, n in used})} names "
          f"from {len({m for m, _ in used})} modules, {len({n for _, n in outside})} outside __all__")


SEQ_RECEIVERS = ("seq", "child", "parent", "dst", "slot", "mirror", "m", "copy", "s")  # (a beam's `hyp` is no Sequence)
MUTATORS = ("append", "extend", "pop", "clear", "insert")


def _receiver(node: ast.expr) -> str:
    """The last name of an attribute chain (``item.seq`` -> ``seq``)."""
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _is_seq(node: ast.expr) -> bool:
    name = _receiver(node).lower()
    return name in SEQ_RECEIVERS or "seq" in name


def sequence_writers() -> tuple[list[str], dict[str, set[str]]]:
    """``Sequence``'s fields (its ``__init__``) and the modules that write each (assign, add to,
    mutate in place) outside ``Sequence`` itself; a heuristic on the receiver's name."""
    src = ROOT / "core" / "interfaces" / "sequence.py"
    if not src.exists():
        src = next((ROOT / "core").rglob("sequence.py"))
    tree = ast.parse(src.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Sequence")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    fields = sorted({t.attr for n in ast.walk(init)
                     for t in getattr(n, "targets", [getattr(n, "target", None)])
                     if isinstance(t, ast.Attribute)})
    public = {f.lstrip("_") for f in fields}
    writers: dict[str, set[str]] = {f: set() for f in public}
    for path in list((ROOT / "core").rglob("*.py")) + list(PLUGINS.rglob("*.py")):
        if path == src:
            continue
        mod = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in MUTATORS):
                targets = [node.func.value]
            flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            for t in flat:
                if isinstance(t, ast.Subscript):
                    t = t.value
                if isinstance(t, ast.Attribute) and t.attr in public and _is_seq(t.value):
                    writers[t.attr].add(mod)
    return fields, {f: w for f, w in writers.items() if w}


def print_sequence_writers() -> None:
    fields, written = sequence_writers()
    pairs = sum(len(w) for w in written.values())
    print(f"Sequence: {len(fields)} fields; {len(written)} written outside it, "
          f"{pairs} (field, module) writes, {len(set().union(*written.values()))} writing modules")
    for f, w in sorted(written.items()):
        print(f"  {f}: {len(w)}  {' '.join(sorted(w))}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tiers", nargs="*", default=["lmplug.interfaces", "lmplug.api", "lmplug.kit"])
    parser.add_argument("--sequence", action="store_true", help="Sequence's fields and their writers")
    args = parser.parse_args()
    for tier in args.tiers:
        report(tier)
    if args.sequence:
        print_sequence_writers()
    return 0


if __name__ == "__main__":
    sys.exit(main())
