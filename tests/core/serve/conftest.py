"""What the server tests share: one torch thread per module, the demo model served on a loopback
port with an API key (``MAX_LEN`` of the test module, 256 by default), and an ``openai`` client."""

from __future__ import annotations

import pytest
from support.hf_models import one_torch_thread  # noqa: F401  (autouse fixture: one torch thread per module)
from support.serve_util import running_server

from lmplug import LLM
from lmplug.serve import ServeSettings

KEY = "test-key"


def max_len(request) -> int:
    return getattr(request.module, "MAX_LEN", 256)


@pytest.fixture(scope="module")
def ref(request, demo_gguf):
    """A second engine on the same model: the reference answers (the served one is busy)."""
    return LLM(str(demo_gguf), dtype="float32", max_model_len=max_len(request))


@pytest.fixture(scope="module")
def server(request, demo_gguf):
    llm = LLM(str(demo_gguf), dtype="float32", max_model_len=max_len(request))
    with running_server(llm, ServeSettings(api_key=KEY, served_model_name="demo")) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.v1, api_key=KEY, max_retries=0, timeout=120)
