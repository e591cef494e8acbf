"""LoRA adapters over HTTP with the official ``openai`` client against a real server on
127.0.0.1: ``model: NAME`` picks an adapter (same output as ``LLM.generate(..., lora=...)``),
/v1/models lists them, load / unload at run time behind the API key, an unknown adapter is a
404 in OpenAI's shape and a bad one a 400 naming it, while the others keep being served."""

from __future__ import annotations

import httpx
import pytest
from support.hf_models import get_model, one_torch_thread, prompt_ids  # noqa: F401
from support.lora_adapters import make_adapter
from support.serve_util import running_server

from lmplug import LLM, LoRARequest, SamplingParams
from lmplug.serve import ServeSettings

KEY = "lora-key"
LORA = {"max_loras": 2, "max_lora_rank": 8}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serve")
    tiny = get_model("llama", root, tokenizer=True)
    for k, rank in enumerate((4, 8, 16)):
        make_adapter(tiny.hf, root / f"a{k}", rank=rank, seed=70 + k)
    llm = LLM(str(tiny.path), dtype="float32", device="cpu", max_model_len=128, lora=LORA)
    settings = ServeSettings(api_key=KEY, served_model_name="base", lora_modules=(("a0", str(root / "a0")),))
    with running_server(llm, settings) as running:
        yield tiny, root, running


@pytest.fixture(scope="module")
def openai_client(setup):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=setup[2].v1, api_key=KEY, max_retries=0, timeout=120)


def _post(running, path, body, key=KEY):
    return httpx.post(running.v1 + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _reference(tiny, prompt, lora):
    with LLM(str(tiny.path), dtype="float32", device="cpu", max_model_len=128, lora=LORA) as ref:
        return ref.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), lora=lora)[0]


def test_model_picks_the_adapter(setup, openai_client):
    tiny, root, _ = setup
    prompt = prompt_ids(10, seed=1)
    texts = {}
    for model, lora in (("a0", LoRARequest("a0", 1, str(root / "a0"))), ("base", None)):
        got = openai_client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert got.model == model
        texts[model] = got.choices[0].text
        assert texts[model] == _reference(tiny, prompt, lora).text
    assert texts["a0"] != texts["base"]


def test_models_lists_the_adapters(setup, openai_client):
    _, root, _ = setup
    cards = {m.id: m for m in openai_client.models.list().data}
    assert {"base", "a0"} <= set(cards)
    assert cards["a0"].parent == "base" and cards["a0"].root == str(root / "a0")


def test_unknown_adapter_is_a_404(openai_client):
    import openai

    with pytest.raises(openai.NotFoundError) as info:
        openai_client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "model_not_found" and "'nope'" in info.value.message


def test_load_and_unload_at_run_time(setup, openai_client):
    import openai

    tiny, root, running = setup
    body = {"lora_name": "a1", "lora_path": str(root / "a1")}
    assert _post(running, "/load_lora_adapter", body, key="wrong").status_code == 401
    assert "a1" not in {m.id for m in openai_client.models.list().data}
    answer = _post(running, "/load_lora_adapter", body)
    assert answer.status_code == 200, answer.text
    prompt = prompt_ids(9, seed=2)
    got = openai_client.completions.create(model="a1", prompt=prompt, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert got.choices[0].text == _reference(tiny, prompt, LoRARequest("a1", 2, str(root / "a1"))).text
    again = _post(running, "/load_lora_adapter", body)
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    assert _post(running, "/unload_lora_adapter", {"lora_name": "a1"}, key="wrong").status_code == 401
    assert _post(running, "/unload_lora_adapter", {"lora_name": "a1"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        openai_client.completions.create(model="a1", prompt=prompt, max_tokens=2)
    gone = _post(running, "/unload_lora_adapter", {"lora_name": "a1"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


def test_bad_adapters_are_a_400_and_the_others_keep_serving(setup, openai_client):
    _, root, running = setup
    for body, words in (({"lora_name": "big", "lora_path": str(root / "a2")}, ["'big'", "max_lora_rank=8"]),
                        ({"lora_name": "gone", "lora_path": str(root / "missing")}, ["'gone'", "not a folder"]),
                        ({"lora_name": "x"}, ["lora_path"])):
        answer = _post(running, "/load_lora_adapter", body)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert all(w in error["message"] for w in words), error
    got = openai_client.completions.create(model="a0", prompt=[5, 6, 7], max_tokens=3, temperature=0)
    assert got.choices[0].finish_reason in ("length", "stop")
