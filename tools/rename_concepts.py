"""Give each plugin concept one name: config section, family, registration hook and package agree.

    python tools/rename_concepts.py [--check] [--lead-docs]

Re-runnable and idempotent (a second run changes nothing), so it can be run again on a branch
that merged code written under the old names:

- speculative decoding (vLLM's ``speculative_config``): section ``speculative`` (unchanged),
  family ``speculative`` (was ``drafter``), hook ``lmplug_register_speculative_methods`` (was
  ``lmplug_register_drafters``), package ``lmplug_speculative`` (unchanged), core
  ``lmplug.speculative`` (was ``lmplug.speculation``);
- prompt compression: section and request field ``compression`` (unchanged), family
  ``compression`` (was ``compressor``), hook ``lmplug_register_compression_methods`` (was
  ``lmplug_register_compressors``), package ``lmplug_compression`` in ``plugins/compression``
  (was ``lmplug_compressor`` in ``plugins/compressor``), entry point ``compression``.

The old family names and hooks stay accepted as deprecated aliases (``lmplug.families``); the
lines that declare them carry the marker ``rename_concepts: keep`` and are left alone, as are
``CHANGELOG.md`` (history) and this file. ``README.md`` and ``docs/architecture.md`` are
rewritten only with ``--lead-docs``; the generated ``docs/hooks.md`` and ``docs/configuration.md``
are left to their generators (``docs/gen_hooks.py``, ``docs/gen_config.py``), run after. ``--check`` changes nothing and exits 1 when a run would.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEEP = "rename_concepts: keep"

# old folder -> new folder (git mv; files another branch added under the old one follow)
MOVES = (
    ("core/speculation", "core/speculative"),
    ("plugins/compressor", "plugins/compression"),
    ("tests/plugins/compressor", "tests/plugins/compression"),
)

# (pattern, replacement, files it applies to: None for every text file)
RULES: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    (r"\blmplug\.speculation\b", "lmplug.speculative", None),
    (r"\bcore/speculation\b", "core/speculative", None),
    (r"(?<![\w/.])speculation/", "speculative/", ("docs/architecture.md",)),
    (r"\blmplug_compressor\b", "lmplug_compression", None),
    (r"\bplugins/compressor\b", "plugins/compression", None),
    (r"\blmplug_register_drafters\b", "lmplug_register_speculative_methods", None),
    (r"\blmplug_register_compressors\b", "lmplug_register_compression_methods", None),
    # family names as strings (registry look-ups, conformance classes, the family table)
    (r"([\"'])drafter\1", r"\1speculative\1", (".py",)),
    (r"([\"'])compressor\1", r"\1compression\1", (".py",)),
    # the entry point's name (``lmplug plugins`` shows it)
    (r"^compressor = \"lmplug_compression\"", 'compression = "lmplug_compression"', ("pyproject.toml",)),
)

TEXT = (".py", ".md", ".toml", ".cfg", ".ini", ".yaml", ".yml", ".txt", ".sh", ".c", ".h", ".json")
# history, this file, and the generated docs (run docs/gen_hooks.py and docs/gen_config.py after)
SKIP = {"CHANGELOG.md", "tools/rename_concepts.py", "docs/hooks.md", "docs/configuration.md"}
LEAD_DOCS = {"README.md", "docs/architecture.md"}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def tracked() -> list[str]:
    return [p for p in git("ls-files", "-z").split("\0") if p]


def planned_moves() -> list[tuple[str, str]]:
    """(old file, new file) for every tracked file still under an old folder."""
    out, files = [], tracked()
    for old, new in MOVES:
        for path in files:
            if path.startswith(old + "/"):
                target = new + path[len(old):]
                if (ROOT / target).exists():
                    sys.exit(f"rename_concepts: both {path} and {target} exist; merge them by hand")
                out.append((path, target))
    return out


COMPILED = [(re.compile(pattern, re.M), repl, only) for pattern, repl, only in RULES]


def rewrite(path: str, text: str) -> str:
    """``text`` with the rules applied in order, each to the lines not kept."""
    for rx, repl, only in COMPILED:
        if (only is None or path.endswith(only)) and rx.search(text):
            text = "".join(ln if KEEP in ln else rx.sub(repl, ln) for ln in text.splitlines(keepends=True))
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a run would")
    ap.add_argument("--lead-docs", action="store_true", help="also rewrite README.md and docs/architecture.md")
    args = ap.parse_args()
    changed: list[str] = []
    for old, new in planned_moves():
        changed.append(f"move {old} -> {new}")
        if not args.check:
            (ROOT / new).parent.mkdir(parents=True, exist_ok=True)
            git("mv", old, new)
    for path in tracked():
        if path in SKIP or (path in LEAD_DOCS and not args.lead_docs) or not path.endswith(TEXT):
            continue
        file = ROOT / path
        if not file.is_file():
            continue
        text = file.read_text(encoding="utf-8")
        new_text = rewrite(path, text)
        if new_text != text:
            changed.append(f"edit {path}")
            if not args.check:
                file.write_text(new_text, encoding="utf-8")
    print("\n".join(changed) if changed else "rename_concepts: nothing to change")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
