"""The ``denoising`` field over HTTP: a tiny random DiffusionGemma (with the tiny vocabulary's
tokenizer) served on loopback answers a completion by denoising, equal to ``LLM.generate`` with the
same params; a bad value, an autoregressive option on it, and ``denoising`` sent to the demo model
are 400s in OpenAI's shape naming the field."""

from __future__ import annotations

import httpx
import pytest
from support.diffusion_gemma import build_diffusion_gemma
from support.hf_models import write_tokenizer
from support.serve_util import running_server

from lmplug import LLM, SamplingParams
from lmplug.serve import ServeSettings

from .conftest import KEY

pytestmark = [pytest.mark.hf]

PROMPT = [5, 17, 33, 8, 21, 40, 9]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("diffusion-http")
    build_diffusion_gemma(path)
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def server(folder):
    llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=96)
    with running_server(llm, ServeSettings(api_key=KEY, served_model_name="dg")) as running:
        yield running


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.v1 + "/completions", json={"model": "dg", "prompt": PROMPT, **body},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def test_a_denoised_completion_equals_llm_generate(server, folder):
    got = post(server, {"max_tokens": 6, "seed": 3, "denoising": {"max_denoising_steps": 4}})
    assert got.status_code == 200, got.text
    want = LLM(str(folder), dtype="float32", device="cpu", max_model_len=96).generate(
        [PROMPT], SamplingParams(max_tokens=6, seed=3, denoising={"max_denoising_steps": 4}))[0]
    assert got.json()["choices"][0]["text"] == want.text


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"denoising": {"max_denoising_steps": 0}}, "denoising", "max_denoising_steps"),
    ({"denoising": {"canvas_length": 8}}, "denoising", "canvas_length"),
    ({"top_p": 0.5}, "top_p", "top_p"),
])
def test_bad_denoising_requests_are_a_400_naming_the_field(server, body, param, words):
    got = post(server, {"max_tokens": 4, **body})
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_denoising_sent_to_an_autoregressive_model_is_a_400(demo_gguf):
    llm = LLM(str(demo_gguf), dtype="float32", max_model_len=128)
    with running_server(llm, ServeSettings(api_key=KEY, served_model_name="demo")) as running:
        got = httpx.post(running.v1 + "/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 2,
                                                            "denoising": {"max_denoising_steps": 4}},
                         headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["param"] == "denoising" and "not a block-diffusion model" in error["message"]
