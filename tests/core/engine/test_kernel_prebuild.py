"""The native CPU kernels are compiled at engine load, never inside a timed generation."""

from __future__ import annotations

import pytest

from lmplug.kit import native_build

C_SOURCE = "int lmplug_answer(void) { return 42; }\n"


def test_build_declared_books_compile_time_once(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(native_build, "_declared", {})
    source = tmp_path / "answer.c"
    source.write_text(C_SOURCE)

    def load():
        lib, _ = native_build.shared_library(source, ("-O1", "-shared", "-fPIC"), native_build.compiler(),
                                             tmp_path / "cache")
        return lib

    native_build.declare("answer", load)
    first = native_build.build_declared()
    assert first > 0.0
    assert len(list((tmp_path / "cache" / "kernels").glob("answer-*.so"))) == 1
    assert native_build.build_declared() == 0.0  # cached: nothing compiled, nothing booked
    assert load().lmplug_answer() == 42


def test_a_kernel_that_cannot_build_is_left_to_its_module(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(native_build, "_declared", {})

    def broken():
        raise native_build.NativeBuildError("no compiler here")

    native_build.declare("broken", broken)
    assert native_build.build_declared() == 0.0


@pytest.mark.slow
def test_engine_load_builds_kernels_before_the_first_generation(tmp_path, monkeypatch, capfd) -> None:
    from lmplug import LLM
    from lmplug.interfaces.params import SamplingParams
    from tests.support.hf_models import get_model

    tiny = get_model("llama", tmp_path / "models", tokenizer=True)
    monkeypatch.setenv("LMPLUG_CACHE", str(tmp_path / "fresh"))  # no kernel cached yet
    llm = LLM(str(tiny.path), dtype="float32", device="cpu", max_model_len=128)
    built = sorted(p.name.split("-")[0] for p in (tmp_path / "fresh" / "kernels").glob("*.so"))
    assert "fused_cpu_ops" in built and "paged_decode_cpu" in built, built
    assert "building CPU kernels for this machine, once:" in capfd.readouterr().err
    before = native_build.compile_seconds()
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))
    assert native_build.compile_seconds() == before  # nothing compiled inside the generation
