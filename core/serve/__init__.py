"""``lmplug.serve``: an OpenAI-compatible HTTP server on the engine (``lmplug serve``).

>>> from lmplug import LLM                                     # doctest: +SKIP
>>> from lmplug.serve import ServeSettings, serve              # doctest: +SKIP
>>> serve(LLM("smollm2-135m-instruct"), ServeSettings(api_key="secret"), port=8000)  # doctest: +SKIP
"""

from lmplug.serve.app import ServeSettings, create_app
from lmplug.serve.async_engine import AsyncEngine
from lmplug.serve.metrics import Metrics
from lmplug.serve.server import Server, build_server, serve

__all__ = ["AsyncEngine", "Metrics", "ServeSettings", "Server", "build_server", "create_app", "serve"]
