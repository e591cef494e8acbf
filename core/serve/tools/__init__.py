"""Tool calling for the OpenAI chat API: tool definitions, ``tool_choice`` as a constraint, and
the parsers that read calls out of model output, whole or streamed.

``check_tools`` validates ``tools``; ``constraint_for`` turns a forcing ``tool_choice``
(``required``, a named function) into a JSON-schema ``StructuredOutput`` and ``forced_calls``
reads the calls back; with ``auto`` a ``ToolParser`` (``parser_for``) finds the calls the model
wrote in its own format; ``template_messages`` prepares a conversation with calls and results for
HF chat templates.
"""

from lmplug.serve.tools.choice import constraint_for, forced_calls
from lmplug.serve.tools.definitions import ToolCall, ToolError, check_tools
from lmplug.serve.tools.messages import template_messages
from lmplug.serve.tools.parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolParser,
    parser_for,
)
from lmplug.serve.tools.streaming import ToolDelta, ToolStreamer

__all__ = [
    "HermesParser", "Llama3JsonParser", "MistralParser", "ToolCall", "ToolDelta", "ToolError", "ToolParser",
    "ToolStreamer", "check_tools", "constraint_for", "forced_calls", "parser_for", "template_messages",
]
