"""Tool calling without a model: tool definitions, tool_choice schemas, the three call formats
parsed whole and streamed (split anywhere), and a conversation with calls rendered through an
HF-style (Qwen2.5) chat template.

The expected calls are written from the formats' published shapes (Qwen/Hermes function calling,
Llama 3.1's JSON tool calling, Mistral's ``[TOOL_CALLS]`` forms); the tool_choice schemas are
checked by ``jsonschema``, not by our own code.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from tokenizers import Tokenizer as Backend

from lmplug.interfaces.constraint import StructuredOutput
from lmplug.loading.tokenizer import Tokenizer
from lmplug.serve.tools import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolDelta,
    ToolError,
    check_tools,
    constraint_for,
    forced_calls,
    parser_for,
    template_messages,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer", "minimum": 1}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, CLOCK]
DECLARED = check_tools(TOOLS)  # what the server passes its parsers: only these calls are calls

PARSERS = {"hermes": HermesParser(), "llama3": Llama3JsonParser(), "mistral": MistralParser()}


def call(name: str, **args) -> tuple[str, dict]:
    return name, args


# (parser, text, expected content, expected calls as (name, arguments as a dict))
CASES = [
    # -- hermes
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [call("get_weather", city="Paris")]),
    ("hermes", ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
     '\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'),
     "Let me check.", [call("get_weather", city="Paris", days=2), call("now")]),
    ("hermes", 'A <tool_call>{"name": "now", "arguments": {}}</tool_call> B',
     "A  B", [call("now")]),
    ("hermes", '<tool_call>{"name": "now"}</tool_call>', None, [call("now")]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>',
     None, [call("get_weather", city="Oslo")]),
    ("hermes", ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京 🌧 naïve \\u00e9"}}'
     '\n</tool_call>'), None, [call("get_weather", city="東京 🌧 naïve é")]),
    ("hermes", 'Hi <tool_call>\n{"name": "now", "arguments": {}}', "Hi", [call("now")]),  # left open at the end
    ("hermes", 'x <tool_call>{"name": "now", "arguments": {</tool_call> y',
     'x <tool_call>{"name": "now", "arguments": {</tool_call> y', []),
    ("hermes", 'x <tool_call>{"name": "now", "argu', 'x <tool_call>{"name": "now", "argu', []),  # cut off
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "now", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "now", "arguments": [1]}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "now", "arguments": {"x": NaN}}</tool_call>',
     '<tool_call>{"name": "now", "arguments": {"x": NaN}}</tool_call>', []),
    ("hermes", 'I use <tool_ tags and <tool_call> in prose.', 'I use <tool_ tags and <tool_call> in prose.', []),
    ("hermes", '<tool_call> <tool_call>{"name": "now", "arguments": {}}</tool_call>', "<tool_call>",
     [call("now")]),
    ("hermes", "no calls at all <", "no calls at all <", []),
    ("hermes", "  \n ", None, []),
    # -- llama3
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [call("get_weather", city="Paris")]),
    ("llama3", '<|python_tag|>{"name": "now", "parameters": {}}', None, [call("now")]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "now", "parameters": {}}',
     None, [call("get_weather", city="Rome"), call("now")]),
    ("llama3", 'Checking. <|python_tag|>{"name": "now", "arguments": {}}', "Checking.", [call("now")]),
    ("llama3", '  {"type": "function", "name": "get_weather", "parameters": {"city": "Zürich"}}',
     None, [call("get_weather", city="Zürich")]),
    ("llama3", 'The answer is {"name": "now", "parameters": {}}', 'The answer is {"name": "now", "parameters": {}}', []),
    ("llama3", '{"name": "now", "parameters": {}} Done.', "Done.", [call("now")]),
    ("llama3", '{"name": "now", "parameters": {}}; {"broken": ', '{"broken":', [call("now")]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "a\\"}]\\\\"}}', None,
     [call("get_weather", city='a"}]\\')]),
    ("llama3", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3", '{"name": "now", "parameters": {]}', '{"name": "now", "parameters": {]}', []),
    ("llama3", "<|python", "<|python", []),
    # -- mistral
    ("mistral", ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "now", "arguments": {}}]'), None, [call("get_weather", city="Paris"), call("now")]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "now", "arguments": {}}]', "Sure.", [call("now")]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon", "days": 3}[TOOL_CALLS]now[ARGS]{}',
     None, [call("get_weather", city="Lyon", days=3), call("now")]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Kraków"} and text', "and text",
     [call("get_weather", city="Kraków")]),
    ("mistral", '[TOOL_CALLS] [{"name": "now", "arguments": {]', '[TOOL_CALLS] [{"name": "now", "arguments": {]', []),
    ("mistral", '[TOOL_CALLS]now[ARGS]{"q": "\\"[{\\\\"}', None, [call("now", q='"[{\\')]),
    ("mistral", '[TOOL_CALLS]bad name[ARGS]{}', '[TOOL_CALLS]bad name[ARGS]{}', []),
    ("mistral", '[TOOL_CALLS]now[ARGS]{"a": ', '[TOOL_CALLS]now[ARGS]{"a":', []),
    ("mistral", '[TOOL_CALLS][]', '[TOOL_CALLS][]', []),
    ("mistral", 'a [TOOL_CALLS]now[AR', 'a [TOOL_CALLS]now[AR', []),
    ("mistral", 'a [TOOL_CALLS]now[ARGS] ', 'a [TOOL_CALLS]now[ARGS]', []),
    ("mistral", '[TOOL_CALLS]now[ARGS][1]', '[TOOL_CALLS]now[ARGS][1]', []),
    ("mistral", 'just [TOOL and [ARGS]', 'just [TOOL and [ARGS]', []),
]


def summary(content, calls):
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_parse(fmt, text, content, calls):
    got_content, got_calls = PARSERS[fmt].parse(text, DECLARED)
    assert summary(got_content, got_calls) == (content, calls)
    for c, (_, args) in zip(got_calls, calls):
        assert c.arguments == json.dumps(args, ensure_ascii=False, separators=(",", ":"))  # compact
        assert c.id.startswith("call_") and len(c.id) == 29 and c.id[5:].isalnum()
    assert len({c.id for c in got_calls}) == len(got_calls)


def joined(deltas: list[ToolDelta]) -> tuple[str | None, list[tuple[str, str]]]:
    """Join a stream the way a client does; checks each call's first piece carries id and name."""
    content = "".join(d.content for d in deltas if d.content is not None)
    calls: dict[int, list] = {}
    for d in deltas:
        if d.index is None:
            assert d.content is not None and d.id is None and d.name is None and d.arguments is None
            continue
        assert d.content is None
        if d.index not in calls:
            assert d.id is not None and d.name is not None, "the first piece of a call names it"
            calls[d.index] = [d.name, ""]
        else:
            assert d.id is None and d.name is None
        calls[d.index][1] += d.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return content or None, [tuple(v) for _, v in sorted(calls.items())]


def stream(fmt: str, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    s = PARSERS[fmt].streamer(DECLARED)
    deltas = []
    for piece in pieces:
        deltas += s.feed(piece)
    return joined(deltas + s.finish())


def parsed(fmt: str, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = PARSERS[fmt].parse(text, DECLARED)
    return content, [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("fmt, text", [(c[0], c[1]) for c in CASES])
def test_stream_split_anywhere_matches_parse(fmt, text):
    want = parsed(fmt, text)
    assert stream(fmt, list(text)) == want  # one character at a time
    for cut in range(len(text) + 1):
        assert stream(fmt, [text[:cut], text[cut:]]) == want, cut
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert stream(fmt, pieces) == want, pieces


# Fragments that random outputs are made of: content, markers, partial markers, calls good and bad.
FRAGMENTS = {
    "hermes": ["Hello", " ", "\n", "<tool_call>", "</tool_call>", "<tool_", "<", '{"name": "now", "arguments": {}}',
               '{"name": "get_weather", "arguments": {"city": "Ünïcode \\" }"}}', '{"name": ', "}", "é"],
    "llama3": ["Hello", " ", "\n", "<|python_tag|>", "<|py", ";", '{"name": "now", "parameters": {}}',
               '{"name": "get_weather", "parameters": {"city": "a]b"}}', '{"x": [', "]}", "{", "ß",
               '{"name": "now", "parameters": {"q": "\\"}\\\\"}}'],
    "mistral": ["Hello", " ", "\n", "[TOOL_CALLS]", "[TOOL", "[ARGS]", "now", "get_weather", "bad name",
                '{"city": "P[]"}', '[{"name": "now", "arguments": {}}]', "[", "]", "{}", "ø"],
}


@pytest.mark.parametrize("fmt", sorted(FRAGMENTS))
def test_random_outputs_stream_like_they_parse(fmt):
    rng = random.Random(23)
    for _ in range(150):
        text = "".join(rng.choice(FRAGMENTS[fmt]) for _ in range(rng.randint(1, 12)))
        want = parsed(fmt, text)
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 10))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert stream(fmt, pieces) == want, text
        assert stream(fmt, list(text)) == want, text
        if not want[1] and "<|python_tag|>" not in text:  # no calls: nothing is lost
            assert want[0] == (text.strip() or None), text


def test_stream_holds_back_only_what_may_start_a_marker():
    s = HermesParser().streamer(DECLARED)
    assert s.feed("Hello <tool_") == [ToolDelta(content="Hello")]  # the space waits for more content
    assert s.feed("box> x") == [ToolDelta(content=" <tool_box> x")]
    assert s.feed(" <tool_call>\n{\"name\": \"now\", ") == []
    out = s.feed('"arguments": {}}\n</tool_call>')  # the call goes out as soon as it closes
    assert [(d.index, d.name, d.arguments) for d in out] == [(0, "now", None), (0, None, "{}")]
    assert s.finish() == []
    with pytest.raises(RuntimeError):
        s.feed("more")


def test_stream_gives_back_an_unclosed_marker_as_content_at_finish():
    s = HermesParser().streamer(DECLARED)
    assert s.feed("See <tool_call> here") == [ToolDelta(content="See")]
    assert s.finish() == [ToolDelta(content=" <tool_call> here")]


def test_long_call_streamed_in_small_pieces():
    args = {"text": "x" * 20000, "n": list(range(2000))}
    text = "<tool_call>" + json.dumps({"name": "now", "arguments": args}) + "</tool_call>"
    for fmt, body in (("hermes", text), ("llama3", json.dumps({"name": "now", "parameters": args}))):
        _, calls = stream(fmt, [body[i:i + 3] for i in range(0, len(body), 3)])
        assert calls == [("now", json.dumps(args, separators=(",", ":")))]


# -- tool_choice ----------------------------------------------------------------------------------


def test_free_choices_have_no_constraint():
    for choice in (None, "auto", "none"):
        assert constraint_for(TOOLS, choice) is None
        assert constraint_for(None, choice) is None


def test_required_schema_accepts_calls_and_refuses_the_rest():
    spec = constraint_for(TOOLS, "required")
    assert isinstance(spec, StructuredOutput) and spec.kind == "json"
    validator = jsonschema.Draft202012Validator(spec.json)
    good = [
        [{"name": "get_weather", "parameters": {"city": "Paris"}}],
        [{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}],
    ]
    bad = [
        [],                                                                   # no call
        [{"name": "get_time", "parameters": {}}],                             # no such tool
        [{"name": "get_weather", "parameters": {"city": 3}}],                 # wrong type
        [{"name": "get_weather", "parameters": {}}],                          # required argument missing
        [{"name": "get_weather", "parameters": {"city": "P", "extra": 1}}],   # not in its schema
        [{"name": "now", "parameters": {}, "id": 1}],                         # extra key
        [{"name": "now"}],                                                    # no parameters
        {"name": "now", "parameters": {}},                                    # not an array
        [{"name": "now", "parameters": "{}"}],                                # parameters as text
    ]
    for value in good:
        validator.validate(value)
    for value in bad:
        assert not validator.is_valid(value), value


def test_named_choice_is_that_tools_parameters():
    spec = constraint_for(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert spec.json == WEATHER["function"]["parameters"]
    validator = jsonschema.Draft202012Validator(spec.json)
    assert validator.is_valid({"city": "Oslo"}) and not validator.is_valid({"days": 1})
    no_args = constraint_for(TOOLS, {"type": "function", "function": {"name": "now"}})
    assert no_args.json == {"type": "object", "properties": {}}


@pytest.mark.parametrize("tools, choice, words", [
    (TOOLS, {"type": "function", "function": {"name": "get_time"}}, "'get_time'"),
    (TOOLS, "sometimes", "expected"),
    (TOOLS, {"type": "function"}, "expected"),
    (TOOLS, {"type": "function", "function": {"name": 3}}, "expected"),
    (TOOLS, {"type": "tool", "function": {"name": "now"}}, "expected"),
    (None, "required", "has none"),
    ([], {"type": "function", "function": {"name": "now"}}, "has none"),
])
def test_bad_tool_choice_names_the_field(tools, choice, words):
    with pytest.raises(ToolError, match=words) as err:
        constraint_for(tools, choice)
    assert err.value.field == "tool_choice"


def test_forced_calls_read_back_the_constrained_output():
    calls = forced_calls('[{"name": "get_weather", "parameters": {"city": "Nîmes"}}, {"name": "now", '
                         '"parameters": {}}]', TOOLS, "required")
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city":"Nîmes"}'), ("now", "{}")]
    assert calls[0].id != calls[1].id
    named = forced_calls('{"city": "Oslo", "days": 2}', TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert [(c.name, c.arguments) for c in named] == [("get_weather", '{"city":"Oslo","days":2}')]


def test_forced_calls_cut_off_output_says_max_tokens():
    with pytest.raises(ToolError, match="max_tokens") as err:
        forced_calls('[{"name": "now", "param', TOOLS, "required")
    assert err.value.field == "tool_choice"
    with pytest.raises(ToolError, match="does not force"):
        forced_calls("{}", TOOLS, "auto")


# -- tool definitions ------------------------------------------------------------------------------


def test_check_tools_normalizes_copies():
    raw = [{"type": "function", "function": {"name": "a", "parameters": {"properties": {"x": {"type": "string"}}},
                                             "strict": True, "extra": 1}}, CLOCK]
    out = check_tools(raw)
    assert out == [{"type": "function", "function": {"name": "a", "strict": True, "parameters": {
                        "type": "object", "properties": {"x": {"type": "string"}}}}},
                   {"type": "function", "function": {"name": "now", "parameters": {"type": "object",
                                                                                    "properties": {}}}}]
    assert "type" not in raw[0]["function"]["parameters"]  # the request is not modified
    assert check_tools([WEATHER]) == [WEATHER]
    assert check_tools([]) == []


def fn(**fields):
    return {"type": "function", "function": {"name": "f", **fields}}


@pytest.mark.parametrize("tools, field", [
    ({"type": "function"}, "tools"),
    ([fn(name=f"f{i}") for i in range(129)], "tools"),
    ([CLOCK, "now"], "tools[1]"),
    ([{"type": "retrieval", "function": {"name": "f"}}], "tools[0].type"),
    ([{"type": "function"}], "tools[0].function"),
    ([fn(name="has space")], "tools[0].function.name"),
    ([fn(name="x" * 65)], "tools[0].function.name"),
    ([fn(name="")], "tools[0].function.name"),
    ([CLOCK, WEATHER, CLOCK], "tools[2].function.name"),
    ([fn(description=3)], "tools[0].function.description"),
    ([fn(strict="yes")], "tools[0].function.strict"),
    ([CLOCK, fn(parameters=[])], "tools[1].function.parameters"),
    ([fn(parameters={"type": "array", "items": {}})], "tools[0].function.parameters"),
    ([fn(parameters={"type": "object", "properties": 3})], "tools[0].function.parameters"),
    ([fn(parameters={"type": "object", "properties": {"x": {"type": "strin"}}})], "tools[0].function.parameters"),
    ([fn(parameters={"type": "object", "default": float("nan")})], "tools[0].function.parameters"),
])
def test_check_tools_errors_name_the_field(tools, field):
    with pytest.raises(ToolError) as err:
        check_tools(tools)
    assert err.value.field == field
    assert str(err.value).startswith(field)


# -- choosing a parser -----------------------------------------------------------------------------


@pytest.mark.parametrize("option, template, name", [
    ("auto", "{% for t in tools %}<tools>{{ t | tojson }}</tools>{% endfor %}<tool_call>", "hermes"),
    ("auto", "<|start_header_id|>ipython<|end_header_id|>", "llama3"),
    ("auto", "{{- '<|python_tag|>' }}", "llama3"),
    ("auto", "{{- '[TOOL_CALLS]' + tool_calls | tojson }}", "mistral"),
    ("auto", "{{ messages }}", "hermes"),   # no markers: the default
    ("auto", None, "hermes"),
    ("llama3", "<tool_call>", "llama3"),    # a named parser wins over the template
    ("mistral", None, "mistral"),
])
def test_parser_for(option, template, name):
    assert parser_for(option, template).name == name


def test_parser_for_none_and_unknown():
    assert parser_for("none", "<tool_call>") is None
    for bad in ("qwen", "", None):
        with pytest.raises(ToolError, match="hermes") as err:
            parser_for(bad, None)
        assert err.value.field == "tool_call_parser"


# -- a conversation with calls, through an HF-style chat template ----------------------------------

# Qwen2.5's tool-calling template, abridged (the same loops over tools, tool_calls and tool turns).
QWEN_STYLE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- endif %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

CHAT = [
    {"role": "user", "content": "Weather in Paris and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, cloudy"},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    from support.hf_models import write_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder)
    backend = Backend.from_file(str(folder / "tokenizer.json"))
    return Tokenizer(backend, name="tiny-qwen-style", eos_token="</s>", chat_template=QWEN_STYLE)


def test_template_messages_render_through_a_qwen_style_template(tokenizer):
    messages = template_messages(CHAT)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[1]["tool_calls"][0]["id"] == "call_1"
    assert [m.get("name") for m in messages[2:]] == ["get_weather", "now"]
    assert CHAT[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # input untouched

    tools = check_tools(TOOLS)
    text = tokenizer.apply_chat_template(messages, tools=tools)
    assert '\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n18 C, cloudy\n</tool_response>\n<tool_response>\n12:00\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.chat_ids(messages, tools=tools)  # the tokenizing path renders it too

    # The calls the template wrote read back as the calls that went in.
    turn = text.split("<|im_start|>assistant")[1].split("<|im_end|>")[0]
    content, calls = parser_for("auto", QWEN_STYLE).parse(turn, DECLARED)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("now", {})]

    # Without the conversion the template writes the arguments as a quoted string, which no
    # parser reads as a call.
    raw = tokenizer.apply_chat_template(CHAT, tools=tools)
    assert '"arguments": "{\\"city\\": \\"Paris\\"}"' in raw


def test_template_messages_bad_arguments_name_the_field():
    bad = [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{oops"}}]}]
    with pytest.raises(ToolError) as err:
        template_messages(bad)
    assert err.value.field == "messages[0].tool_calls[0].function.arguments"
    bad[0]["tool_calls"][0]["function"]["arguments"] = "[1, 2]"
    with pytest.raises(ToolError, match="expected a JSON object"):
        template_messages(bad)
    with pytest.raises(ToolError) as err:
        template_messages([{"role": "assistant", "tool_calls": [{"id": "c", "function": "now"}]}])
    assert err.value.field == "messages[0].tool_calls[0]"


def test_a_parser_of_special_token_markers_gets_them_in_the_text():
    """Mistral's [TOOL_CALLS] is a control token: with that parser the request's output keeps
    special tokens, or ``auto`` could never see a call; the other parsers leave the default."""
    from lmplug.serve import convert
    from lmplug.serve.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                tools=[{"type": "function", "function": {"name": "f"}}], max_tokens=4)
    for option, skipped in [("mistral", False), ("hermes", True), ("llama3", True)]:
        plan = convert.tool_plan(req, parser_for(option, None))
        params = convert.sampling_params(req, [[1, 2, 3]], 64, None, None, plan)
        assert params.skip_special_tokens is skipped, option
    plain = convert.sampling_params(req, [[1, 2, 3]], 64, None, None, None)
    assert plain.skip_special_tokens is True


# -- conformance: only declared calls with valid arguments are calls (issue 45) -----------------

DELETE = '{"name": "delete_all_files", "arguments": {"path": "/"}}'
ODD_NAME = '{"name": "../../x y", "arguments": {}}'
BAD_ARGS = '{"name": "get_weather", "arguments": {"city": 3}}'  # city is a string
EXTRA_ARG = '{"name": "get_weather", "arguments": {"city": "Oslo", "x": 1}}'  # additionalProperties: false
MISSING = '{"name": "get_weather", "arguments": {}}'  # city is required


def written_as(fmt: str, call_json: str) -> str:
    """One call in each format's own spelling."""
    if fmt == "hermes":
        return f"<tool_call>\n{call_json}\n</tool_call>"
    if fmt == "llama3":
        return call_json.replace('"arguments"', '"parameters"')
    obj = json.loads(call_json)
    return f"[TOOL_CALLS]{obj['name']}[ARGS]{json.dumps(obj['arguments'])}" if " " not in obj["name"] and (
        "/" not in obj["name"]) else f"[TOOL_CALLS] [{call_json}]"


@pytest.mark.parametrize("fmt", sorted(PARSERS))
@pytest.mark.parametrize("bad", [DELETE, ODD_NAME, BAD_ARGS, EXTRA_ARG, MISSING])
def test_undeclared_or_invalid_calls_stay_content(fmt, bad):
    text = written_as(fmt, bad)
    whole = PARSERS[fmt].parse(text, DECLARED)
    assert whole == (text.strip(), []), whole
    # streamed in any split: no call delta ever goes out, and the text arrives as content
    for cut in range(1, len(text)):
        s = PARSERS[fmt].streamer(DECLARED)
        deltas = s.feed(text[:cut]) + s.feed(text[cut:]) + s.finish()
        assert all(d.index is None for d in deltas), (cut, deltas)
        assert "".join(d.content or "" for d in deltas) == text.strip()


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_no_declared_tools_means_no_calls(fmt):
    text = written_as(fmt, '{"name": "now", "arguments": {}}')
    assert PARSERS[fmt].parse(text, None) == (text.strip(), [])
    assert PARSERS[fmt].parse(text, DECLARED)[1][0].name == "now"  # the same text, declared, is a call


def test_a_mistral_list_with_one_undeclared_call_is_all_text():
    text = f'[TOOL_CALLS] [{{"name": "now", "arguments": {{}}}}, {DELETE}]'
    assert MistralParser().parse(text, DECLARED) == (text, [])
