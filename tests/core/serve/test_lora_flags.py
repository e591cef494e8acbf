"""``lmplug serve``'s LoRA flags (vLLM's): --lora-modules NAME=PATH ..., --enable-lora,
--max-loras, --max-lora-rank into the settings and the ``lora:`` section."""

from __future__ import annotations

import pytest

from lmplug.cli import _parser, _with_lora
from lmplug.serve.server import lora_modules


def _args(*flags):
    return _parser().parse_args(["serve", "m", *flags])


def test_flags_make_the_lora_section():
    args = _args("--lora-modules", "a=/x", "b=/y", "--lora-modules", "c=/z", "--max-lora-rank", "32")
    assert lora_modules(args.lora_modules) == (("a", "/x"), ("b", "/y"), ("c", "/z"))
    assert _with_lora(args)({"model": "m"})["lora"] == {"max_lora_rank": 32}
    assert _with_lora(_args("--enable-lora"))({})["lora"] == {}
    assert "lora" not in _with_lora(_args())({})
    assert _with_lora(_args("--max-loras", "8"))({"lora": {"max_lora_rank": 4}})["lora"] == \
        {"max_lora_rank": 4, "max_loras": 8}


@pytest.mark.parametrize("bad", [["a"], ["=p"], ["a="], ["a=/x", "a=/y"]])
def test_malformed_lora_modules_exit_naming_the_flag(bad):
    with pytest.raises(SystemExit, match="--lora-modules"):
        lora_modules(bad)
