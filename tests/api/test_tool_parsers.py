"""Tool-call parsers on model-style texts: finished outputs, and streams split at every point, whose
deltas must join to exactly what the finished parse reports."""

import json

import pytest

from jaxserve.api.tools import TOOL_PARSERS, ToolCallStream
from jaxserve.api.tools.forced import NamedCallParser, RequiredCallsParser
from jaxserve.api.tools.plan import plan_tools
from jaxserve.sampling_params import InvalidParam

HERMES_TWO_CALLS = (
    "I'll look both up.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris, \\\"FR\\\"\", "
    "\"days\": [1, 2], \"opts\": {\"unit\": \"c\"}}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", "
    "\"arguments\": {}}\n</tool_call>"
)
LLAMA_TWO_CALLS = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                   '{"name": "now", "parameters": {}}')
# Qwen3-Coder's arguments are typed by the request's schemas
CODER_FUNCTIONS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"},
        "metric": {"type": "boolean"}, "opts": {"type": "object"}, "hours": {"type": "array"},
        "code": {"type": "string"}, "note": {"type": ["string", "null"]}}}},
    {"name": "now", "parameters": {"type": "object", "properties": {}}},
]
CODER_TWO_CALLS = (
    "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis, \"FR\"\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n<parameter=metric>\nTrue\n"
    "</parameter>\n<parameter=opts>\n{\"unit\": \"c\", \"n\": [1, null]}\n</parameter>\n<parameter=hours>\n"
    "[6, 12]\n</parameter>\n<parameter=code>\n\ndef f(x):\n    return x < 3\n\n</parameter>\n<parameter=note>\n"
    "null\n</parameter>\n<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
    "<function=now>\n</function>\n</tool_call>"
)
CODER_ARGUMENTS = {"city": 'Paris, "FR"', "days": 3, "ratio": 0.5, "metric": True,
                   "opts": {"unit": "c", "n": [1, None]}, "hours": [6, 12],
                   "code": "\ndef f(x):\n    return x < 3\n", "note": None, "extra": "42"}
# GLM-4.5's: a value stays text where its schema says "string", else it is read as JSON (or a Python literal)
GLM_TWO_CALLS = (
    "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris, \"FR\"</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>ratio</arg_key>\n<arg_value>0.5</arg_value>\n"
    "<arg_key>metric</arg_key>\n<arg_value>true</arg_value>\n<arg_key>opts</arg_key>\n<arg_value>{\"unit\": \"c\", "
    "\"n\": [1, null]}</arg_value>\n<arg_key>hours</arg_key>\n<arg_value>[6, 12]</arg_value>\n<arg_key>code</arg_key>\n"
    "<arg_value>\ndef f(x):\n    return x < 3\n</arg_value>\n<arg_key>extra</arg_key>\n<arg_value>42</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>9</arg_value>\n</tool_call>\n<tool_call>now\n</tool_call>"
)
LONG_NAME_PROSE = "<tool_call>" + "x" * 300 + "\n</tool_call>"
GLM_ARGUMENTS = {"city": 'Paris, "FR"', "days": 3, "ratio": 0.5, "metric": True, "opts": {"unit": "c", "n": [1, None]},
                 "hours": [6, 12], "code": "\ndef f(x):\n    return x < 3\n", "extra": 42}  # strings exact
HARMONY_TWO_CALLS = (  # a preamble, then a call as GPT-OSS writes it and one in the chat template's form
    '<|channel|>analysis<|message|>Both.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>'
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo, '
    '\\"NO\\""}<|end|><|start|>assistant to=functions.now<|channel|>commentary json<|message|> {} <|call|>'
)
# DeepSeek's markers (special tokens): V3's calls name a type and fence their arguments; V3.1's do neither
CALLS_BEGIN, CALLS_END = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
CALL_BEGIN, CALL_END = "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>"
SEP = "<\uff5ctool\u2581sep\uff5c>"
DEEPSEEK_V3_TWO_CALLS = (
    f'Let me check.{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n{{"city": "Paris, \\"FR\\"", '
    f'"days": [1, 2]}}\n```{CALL_END}\n{CALL_BEGIN}function{SEP}now\n```json\n{{}}\n```{CALL_END}{CALLS_END}')
DEEPSEEK_V31_TWO_CALLS = (f'{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}{{"city": "```json {{"}}{CALL_END}'
                          f'{CALL_BEGIN}now{SEP}{{}}{CALL_END}{CALLS_END}')
CASES = [
    (TOOL_PARSERS["deepseek_v3"](), DEEPSEEK_V3_TWO_CALLS, "Let me check.",
     [("get_weather", {"city": 'Paris, "FR"', "days": [1, 2]}), ("now", {})]),
    (TOOL_PARSERS["deepseek_v3"](), "Fences: ```json {} ``` are content.", "Fences: ```json {} ``` are content.", []),
    (TOOL_PARSERS["deepseek_v31"](), DEEPSEEK_V31_TWO_CALLS, None,
     [("get_weather", {"city": "```json {"}), ("now", {})]),
    (TOOL_PARSERS["deepseek_v31"](), "Plain answer.", "Plain answer.", []),
    (TOOL_PARSERS["openai"](), HARMONY_TWO_CALLS, "Checking.", [("get_weather", {"city": 'Oslo, "NO"'}), ("now", {})]),
    (TOOL_PARSERS["openai"](), '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": "<|x"}', None,
     [("f", {"a": "<|x"})]),  # its <|call|> stopped generation, so it is not in the text
    (TOOL_PARSERS["qwen3_coder"](CODER_FUNCTIONS), CODER_TWO_CALLS, "Let me check.\n",
     [("get_weather", CODER_ARGUMENTS), ("now", {})]),
    # no <tool_call> around it, no newlines, and a closing </parameter> left out (vLLM reads these too)
    (TOOL_PARSERS["qwen3_coder"](CODER_FUNCTIONS), "<function=get_weather><parameter=days>x7</parameter>"
     "<parameter=city>Oslo</function>", None, [("get_weather", {"days": "x7", "city": "Oslo"})]),
    (TOOL_PARSERS["qwen3_coder"](), "<tool_call>\n<function=f>\n<parameter=n>\n1.5e3\n</parameter>\n</function>",
     None, [("f", {"n": "1.5e3"})]),  # no schema for it: a string
    (TOOL_PARSERS["qwen3_coder"](), "Write <b>bold</b> with a <tool_call> tag.",
     "Write <b>bold</b> with a <tool_call> tag.", []),
    (TOOL_PARSERS["qwen3_coder"](), "Plain answer.", "Plain answer.", []),
    (TOOL_PARSERS["glm45"](CODER_FUNCTIONS), GLM_TWO_CALLS, "Let me check.\n",
     [("get_weather", GLM_ARGUMENTS), ("now", {})]),
    # GLM-4.7's spelling: no newlines; a value that parses as nothing stays text; a name with no schema
    (TOOL_PARSERS["glm47"](CODER_FUNCTIONS), "<tool_call>get_weather<arg_key>days</arg_key><arg_value>x7</arg_value>"
     "<arg_key>note</arg_key> <arg_value>None</arg_value></tool_call><tool_call>ls <arg_key>dir</arg_key>"
     "<arg_value>'a b'</arg_value> </tool_call>", None,
     [("get_weather", {"days": "x7", "note": None}), ("ls", {"dir": "a b"})]),
    # closing tags left out: a value ends at the next key or the call's end, a key at its value; never past the call
    (TOOL_PARSERS["glm45"](), "<tool_call>f\n<arg_key>a</arg_key><arg_value>1</tool_call><tool_call>g\n<arg_key>b"
     "<arg_value>2\n<arg_key>c</arg_key><arg_value>[3]</arg_value></tool_call>", None,
     [("f", {"a": 1}), ("g", {"b": 2, "c": [3]})]),
    # a name of 200 characters is one; 300 characters after a marker with no end of a name are prose
    (TOOL_PARSERS["glm45"](), "<tool_call>" + "n" * 200 + "\n</tool_call>", None, [("n" * 200, {})]),
    (TOOL_PARSERS["glm45"](), LONG_NAME_PROSE, LONG_NAME_PROSE, []),
    (TOOL_PARSERS["glm45"](), "Write <b>bold</b> with a <tool_call> tag.", "Write <b>bold</b> with a <tool_call> tag.",
     []),
    # stopped by itself inside a value (no max_tokens): the value and the call end there
    (TOOL_PARSERS["glm45"](), "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1", None, [("f", {"a": 1})]),
    (TOOL_PARSERS["glm45"](), "Use <tool_call> tags\nlike this.", "Use <tool_call> tags\nlike this.", []),
    (TOOL_PARSERS["glm45"](), "Plain answer.", "Plain answer.", []),
    (TOOL_PARSERS["hermes"](), HERMES_TWO_CALLS, "I'll look both up.\n",
     [("get_weather", {"city": 'Paris, "FR"', "days": [1, 2], "opts": {"unit": "c"}}), ("get_time", {})]),
    (TOOL_PARSERS["hermes"](), "No tools needed: 2 < 3 and <b>bold</b>.", "No tools needed: 2 < 3 and <b>bold</b>.",
     []),
    (TOOL_PARSERS["llama3_json"](), LLAMA_TWO_CALLS, None, [("get_weather", {"city": "Oslo"}), ("now", {})]),
    (TOOL_PARSERS["llama3_json"](), ' {"name": "f", "parameters": {"x": -1.5e3}}', None, [("f", {"x": -1.5e3})]),
    (TOOL_PARSERS["llama3_json"](), "The answer is {42}.", "The answer is {42}.", []),
    (RequiredCallsParser(), '[{"name": "a", "parameters": {"s": "]}"}}, {"name": "b", "parameters": {"n": 1}}]', None,
     [("a", {"s": "]}"}), ("b", {"n": 1})]),
    (NamedCallParser("f"), '{"q": "x", "n": [true, null]}', None, [("f", {"q": "x", "n": [True, None]})]),
    (TOOL_PARSERS["mistral"](), 'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "[ARGS]"}}, '
     '{"name": "now", "arguments": {}}]', "Checking.", [("get_weather", {"city": "[ARGS]"}), ("now", {})]),
    (TOOL_PARSERS["mistral"](), '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "n": [1]}[TOOL_CALLS]now[ARGS]{}',
     None, [("get_weather", {"city": "Oslo", "n": [1]}), ("now", {})]),
    (TOOL_PARSERS["mistral"](), "Use [TOOL brackets] freely.", "Use [TOOL brackets] freely.", []),
    (TOOL_PARSERS["pythonic"](), '[get_weather(city="Paris, \'FR\')", days=[1, 2], opts={"u": None}), now()]', None,
     [("get_weather", {"city": "Paris, 'FR')", "days": [1, 2], "opts": {"u": None}}), ("now", {})]),
    (TOOL_PARSERS["pythonic"](), ' [f(s="""a)b""", x=-1.5, ok=True)]', None,
     [("f", {"s": "a)b", "x": -1.5, "ok": True})]),
    (TOOL_PARSERS["pythonic"](), "[1, 2] are numbers.", "[1, 2] are numbers.", []),
    (TOOL_PARSERS["pythonic"](), "Plain answer.", "Plain answer.", []),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_parse(parser, text, content, calls):
    parsed_content, parsed = parser.parse(text)
    assert parsed_content == (content if calls else text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls
    assert len({c.id for c in parsed}) == len(parsed)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
@pytest.mark.parametrize("step", [1, 2, 7])
def test_stream_equals_parse(parser, text, content, calls, step):
    stream = ToolCallStream(parser)
    streamed_content, names, arguments, ids = "", {}, {}, {}
    for start in range(0, len(text), step):
        piece = text[start : start + step]
        new_content, deltas = stream.feed(piece, final=start + step >= len(text))
        streamed_content += new_content
        for d in deltas:
            if d.id is not None:  # the first delta of a call: id and name, once
                assert d.index not in ids and d.name is not None
                ids[d.index], names[d.index] = d.id, d.name
            else:
                assert d.name is None and d.index in ids
            arguments[d.index] = arguments.get(d.index, "") + (d.arguments or "")
    _, parsed = parser.parse(text)
    assert streamed_content == (content or "" if calls else text)
    assert [names[i] for i in sorted(names)] == [c.name for c in parsed]
    assert [arguments[i] for i in sorted(arguments)] == [c.arguments for c in parsed]


def test_stream_never_sends_half_a_marker_as_content():
    stream = ToolCallStream(TOOL_PARSERS["hermes"]())
    sent = ""
    for piece in ["Sure", " <tool", "_ca", "ll>", '{"name": "f", "arguments": {"a": 1}}', "</tool_call>"]:
        content, _ = stream.feed(piece)
        sent += content
        assert "<tool" not in sent
    assert sent == "Sure "


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_a_call_nested_past_python_s_recursion_limit_is_content_not_a_crash(name):
    """A model can be made to write arguments (or a name) nested deeper than Python's parser goes (a forced
    tool whose schema is a $ref chain). Parsing it raised RecursionError after the generation: a 500 that
    lost the output. Such a call is text that is not JSON to Python, so it stays content."""
    deep = "[" * 5000 + "1" + "]" * 5000
    text = {"hermes": f'<tool_call>{{"name": "f", "arguments": {{"a": {deep}}}}}</tool_call>',
            "llama3_json": f'{{"name": "f", "parameters": {{"a": {deep}}}}}',
            "mistral": f'[TOOL_CALLS][{{"name": {deep}, "arguments": {{}}}}]'}[name]
    content, calls = TOOL_PARSERS[name]().parse(text)
    assert calls == [] and content == text


def test_unfinished_call_is_content_when_parsed():
    text = '<tool_call>{"name": "f", "arguments": {"a": '
    assert TOOL_PARSERS["hermes"]().parse(text) == (text, [])


@pytest.mark.parametrize(("parser", "text"), [
    (TOOL_PARSERS["hermes"](), '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "argu'),
    (TOOL_PARSERS["mistral"](), '[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[AR'),
    (TOOL_PARSERS["pythonic"](), "[a(), b(x=[1, "),
    (TOOL_PARSERS["openai"](), "<|channel|>commentary to=functions.a <|constrain|>json<|message|>{}<|end|><|start|>"
                               'assistant<|channel|>commentary to=functions.b <|constrain|>json<|message|>{"y": '),
])
def test_a_truncated_output_keeps_its_complete_calls(parser, text):
    _, calls = parser.parse(text, truncated=True)
    assert [c.name for c in calls] == ["a"] and json.loads(calls[0].arguments) in ({}, {"x": 1})
    assert parser.parse(text) == (text, []), "not cut by max_tokens: an unfinished call is content"


def test_a_required_choice_cut_inside_its_first_call_is_neither_content_nor_a_call():
    """`tool_choice: "required"`: the grammar made the text calls, so an output cut before its first call was
    complete is not content (it was given as the raw JSON); cut later, its complete calls are kept."""
    for text in ('[{"name": "a", "parameters": {"x', '[{"name": "a", "parameters":', "["):
        assert RequiredCallsParser().parse(text, truncated=True) == (None, [])
    _, calls = RequiredCallsParser().parse('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "par',
                                           truncated=True)
    assert [(c.name, c.arguments) for c in calls] == [("a", '{"x": 1}')]


def test_calls_with_arguments_that_are_not_literals_are_content():
    for text in ("[f(x=open('/etc/passwd'))]", "[f(1, 2)]", "[f(**kw)]"):
        assert TOOL_PARSERS["pythonic"]().parse(text) == (text, [])


def test_mistral_call_ids_are_nine_alphanumerics():
    _, calls = TOOL_PARSERS["mistral"]().parse('[TOOL_CALLS]f[ARGS]{"a": 1}')
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()
    assert plan_tools(FUNCTIONS, "auto", True, TOOL_PARSERS["mistral"]).keeps_special_tokens


def test_parallel_false_streams_one_call():
    stream = ToolCallStream(TOOL_PARSERS["hermes"](), max_calls=1)
    _, deltas = stream.feed(HERMES_TWO_CALLS, final=True)
    assert {d.index for d in deltas} == {0} and stream.num_calls == 1


FUNCTIONS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
             {"name": "now"}]


def test_plan_tools_rules():
    assert plan_tools([], None, True, None) is None
    assert plan_tools(FUNCTIONS, "none", True, None) is None
    named = plan_tools(FUNCTIONS, {"type": "function", "function": {"name": "now"}}, True, None)
    assert named.structure.json == {"type": "object"} and named.max_calls == 1
    required = plan_tools(FUNCTIONS, "required", False, None)
    assert required.structure.json["maxItems"] == 1 and required.structure.json["minItems"] == 1
    assert plan_tools(FUNCTIONS, "auto", True, TOOL_PARSERS["hermes"]).structure is None
    for choice, functions, match in [
        ("auto", FUNCTIONS, "enable-auto-tool-choice"), (None, FUNCTIONS, "enable-auto-tool-choice"),
        ({"type": "function", "function": {"name": "nope"}}, FUNCTIONS, "not among"),
        ("required", [], "needs tools"), ("required", FUNCTIONS * 2, "unique"),
    ]:
        with pytest.raises(InvalidParam, match=match):
            plan_tools(functions, choice, True, None)


def test_qwen3_coder_arguments_grow_one_whole_argument_at_a_time():
    stream = ToolCallStream(TOOL_PARSERS["qwen3_coder"](CODER_FUNCTIONS))
    fragments = []
    for i in range(len(CODER_TWO_CALLS)):
        _, deltas = stream.feed(CODER_TWO_CALLS[i], final=i == len(CODER_TWO_CALLS) - 1)
        fragments += [d.arguments for d in deltas if d.index == 0 and d.arguments]
    assert fragments[0] == "{" and fragments[-1] == "}"
    # each fragment between the braces is one argument, typed: never half a value
    assert [json.loads("{" + f.removeprefix(", ") + "}") for f in fragments[1:-1]] == [
        {k: v} for k, v in CODER_ARGUMENTS.items()]


@pytest.mark.parametrize(("text", "schema", "value"), [
    ("12", {"type": "integer"}, 12), ("-3", {"type": "int"}, -3), ("twelve", {"type": "integer"}, "twelve"),
    ("2", {"type": "number"}, 2), ("2.5", {"type": "number"}, 2.5), ("2.0", {"type": "number"}, 2),
    ("1e3", {"type": "number"}, 1000),  # vLLM's: an integral number is an integer
    ("nan?", {"type": "number"}, "nan?"), ("false", {"type": "boolean"}, False), ("yes", {"type": "boolean"}, False),
    ("True", {"type": "bool"}, True),
    ("NULL", {"type": "string"}, None), ("[1, 'a']", {"type": "array"}, [1, "a"]),
    ("{oops", {"type": "object"}, "{oops"), ("1" * 5000, {"type": "integer"}, "1" * 5000),
    ("3", None, "3"), ("3", {"type": ["integer", "null"]}, 3), ("null", {"type": ["integer", "null"]}, None),
    ("3", {"type": ["null"]}, "3"), ("3", "not a schema", "3"), ("3", {"type": 7}, "3"),
    # values with no JSON form stay text: NaN and infinities, Python's sets, bytes and complex numbers
    ("nan", {"type": "number"}, "nan"), ("-inf", {"type": "float"}, "-inf"), ("NaN", {"type": "object"}, "NaN"),
    ("{1, 2}", {"type": "array"}, "{1, 2}"), ("b'x'", {"type": "object"}, "b'x'"), ("1j", {"type": "object"}, "1j"),
])
def test_qwen3_coder_types_an_argument_by_its_schema(text, schema, value):
    from jaxserve.api.tools.qwen3_coder import typed_value

    assert typed_value(text, schema) == value and type(typed_value(text, schema)) is type(value)


def test_the_auto_plan_gives_the_parser_the_requests_schemas():
    plan = plan_tools(CODER_FUNCTIONS, "auto", True, TOOL_PARSERS["qwen3_coder"])
    _, calls = plan.make_parser().parse("<function=get_weather><parameter=days>5</parameter></function>")
    assert json.loads(calls[0].arguments) == {"days": 5}


# parser -> an output with one complete call, then one open inside its argument's value
UNCLOSED = {
    "qwen3_coder": "Sure.\n<tool_call>\n<function=a>\n</function>\n</tool_call>\n<tool_call>\n<function=b>\n"
                   "<parameter=x>\n1\n",
    "glm45": "Sure.\n<tool_call>a\n</tool_call>\n<tool_call>b\n<arg_key>x</arg_key>\n<arg_value>1",
}


@pytest.mark.parametrize("name", sorted(UNCLOSED))
@pytest.mark.parametrize("step", [1, 5, 1000])
def test_typed_arguments_read_calls_an_output_stopped_short_of_closing_unless_cut(name, step):
    """An output that ended by itself (EOS) before its closing tags ends its open argument and call there, as
    vLLM reads Qwen3-Coder's; one cut by max_tokens keeps only its complete calls (its last value may be cut too).
    Streamed, the last delta says which, so a stream's calls are the finished parse's."""
    text = UNCLOSED[name]
    for truncated, expected in ((False, [("a", {}), ("b", {"x": 1})]), (True, [("a", {})])):
        parser = TOOL_PARSERS[name]([{"name": "b", "parameters": {"properties": {"x": {"type": "integer"}}}}])
        content, calls = parser.parse(text, truncated=truncated)
        assert content == "Sure.\n" and [(c.name, json.loads(c.arguments)) for c in calls] == expected
        stream, arguments = ToolCallStream(parser), {}
        for start in range(0, len(text), step):
            final = start + step >= len(text)
            _, deltas = stream.feed(text[start : start + step], final=final, truncated=truncated)
            for d in deltas:
                arguments[d.index] = arguments.get(d.index, "") + (d.arguments or "")
        assert json.loads(arguments[0]) == {}
        if not truncated:  # a cut stream has sent the open call's start: what it sent is all it had
            assert json.loads(arguments[1]) == {"x": 1}


def test_qwen3_coder_keeps_its_calls_before_a_bare_last_tool_call_tag():
    text = "<tool_call>\n<function=now>\n</function>\n</tool_call>\n<tool_call>\n"
    assert [c.name for c in TOOL_PARSERS["qwen3_coder"]().parse(text)[1]] == ["now"]


@pytest.mark.parametrize(("text", "before"), [
    ("<tool_call>\n<function=now>\n</function>\n</tool_call>\n<function=", None),
    ("<<tool_call><function=now>  f</</tool_call>f<function=", "<")])
def test_qwen3_coder_keeps_its_calls_before_a_bare_last_function_tag_streamed_or_not(text, before):
    """A `<function=` at the output's end with no name after it begins nothing: the calls before it stand, as the
    stream has already sent them (a review's fuzzing of stream against parse found the finished parse reporting
    all of it as content)."""
    content, calls = TOOL_PARSERS["qwen3_coder"]().parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("now", {})] and content == before
    stream, names = ToolCallStream(TOOL_PARSERS["qwen3_coder"]()), []
    for index in range(len(text)):
        _, deltas = stream.feed(text[index], final=index == len(text) - 1)
        names += [d.name for d in deltas if d.name]
    assert names == ["now"]


def test_qwen3_coder_looks_past_a_tool_call_tag_in_prose():
    text = "Qwen writes <tool_call> tags. Now:\n<tool_call>\n<function=now>\n</function>\n</tool_call>"
    content, calls = TOOL_PARSERS["qwen3_coder"]().parse(text)
    assert content == "Qwen writes <tool_call> tags. Now:\n" and [c.name for c in calls] == ["now"]
    assert TOOL_PARSERS["qwen3_coder"]().parse('<function=f><parameter=s>\n東京\n</parameter></function>')[1][
        0].arguments == '{"s": "東京"}', "arguments are written as vLLM writes them, not ASCII-escaped"


HARMONY_ODD = [  # a model that strays from the format: streams cut anywhere must read as the whole text
    "<|channel|>analysis<|message|>x<|end|> to=functions.f<|channel|>commentary json<|message|>{}",
    "\n to=functions.f<|channel|>commentary json<|message|>{}",
    "<|channel|>analysis<|message|>x<|end|> to=assistant<|channel|>final<|message|>Hello world, the answer",
    "<|channel|>final<|message|>a<|end|>to=<|channel|>analysis<|message|>s",
    "<|channel|>commentary to=functions.f<|message|>{}<|channel|>final<|message|>x",
    "<|channel|> final<|message|>a<|channel|>commentary to=functions.<|message|>{}",
    '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"city":"Os',
]


@pytest.mark.parametrize("text", HARMONY_ODD)
@pytest.mark.parametrize("reasoning", [False, True])
def test_a_harmony_stream_cut_anywhere_reads_as_the_whole_output(text, reasoning):
    """With the reasoning split before it (as `--reasoning-parser openai_gptoss` serves) or alone, the call
    parser's stream, cut at any point, sends the content and the calls that the whole output's parse holds."""
    from jaxserve.api.harmony import HarmonyStream

    whole = HarmonyStream().feed(text, final=True)[1] if reasoning else text
    content, calls = TOOL_PARSERS["openai"]().parse(whole)
    assert "<|" not in (content or "") or not calls
    for cut in range(len(text) + 1):
        splitter, stream = HarmonyStream(), ToolCallStream(TOOL_PARSERS["openai"]())
        sent, arguments = "", {}
        for piece, final in ((text[:cut], False), (text[cut:], True)):
            piece = splitter.feed(piece, final)[1] if reasoning else piece
            new, deltas = stream.feed(piece, final)
            sent += new
            for delta in deltas:
                arguments[delta.index] = arguments.get(delta.index, "") + (delta.arguments or "")
        if calls:
            assert sent == (content or "") and list(arguments.values()) == [c.arguments for c in calls], cut
        else:  # calls that do not all parse: what the stream sent is a beginning of what the parse says
            assert (content or "").startswith(sent.rstrip()) or not arguments, cut


def test_a_reused_harmony_parser_reads_a_longer_text_afresh():
    text = "<|channel|>final<|message|>hi<|ca"
    parser = TOOL_PARSERS["openai"]()
    parser.parse(text)
    longer = text + "ll|><|start|>assistant<|channel|>commentary to=functions.f<|message|>{}"
    content, calls = parser.parse(longer)
    assert content == "hi" and [(c.name, c.arguments) for c in calls] == [("f", "{}")]


@pytest.mark.parametrize(("text", "content"), [
    ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Four.<|return|>",
     "Four."),
    ("<|channel|>final<|message|>No tools: to=functions.f is text here.", "No tools: to=functions.f is text here."),
    ("Not harmony at all.", "Not harmony at all."),
    ("<|channel|>commentary to=browser.search <|constrain|>json<|message|>{}", "{}"),  # a built-in tool: no call
])
@pytest.mark.parametrize("step", [1, 5])
def test_a_harmony_output_without_calls_is_its_messages_content(text, content, step):
    """GPT-OSS's text is its messages' bodies, not its markup, when it calls nothing (the analysis channel is
    reasoning, left to the reasoning parser)."""
    assert TOOL_PARSERS["openai"]().parse(text) == (content, [])
    stream = ToolCallStream(TOOL_PARSERS["openai"]())
    pieces = [stream.feed(text[i : i + step], final=i + step >= len(text)) for i in range(0, len(text), step)]
    assert "".join(piece for piece, _ in pieces) == (content or "") and not any(calls for _, calls in pieces)


def test_a_named_tool_choice_cut_by_max_tokens_is_still_its_call_as_the_stream_sends_it():
    """vLLM's: a named tool choice's output is that function's arguments, a tool call however it ended. Cut
    by max_tokens, the arguments as far as they got, as the stream sent them; it was content before, so a
    client got a call streamed and content otherwise."""
    text = '{"city": "Par'
    content, calls = NamedCallParser("get_weather").parse(text, truncated=True)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", text)]
    stream = ToolCallStream(NamedCallParser("get_weather"))
    _, deltas = stream.feed(text, final=True)
    assert "".join(d.arguments or "" for d in deltas) == text and deltas[0].name == "get_weather"


def test_glm45_looks_past_a_tool_call_tag_in_prose_and_types_by_the_schema():
    text = "GLM writes <tool_call> tags\nin prose. Now:\n<tool_call>f\n<arg_key>s</arg_key><arg_value> 007 " \
           "</arg_value><arg_key>n</arg_key><arg_value>007</arg_value><arg_key>x</arg_key><arg_value>NaN</arg_value></tool_call>"
    schema = [{"name": "f", "parameters": {"properties": {"s": {"type": "string"}, "n": {"type": "integer"}}}}]
    content, calls = TOOL_PARSERS["glm45"](schema).parse(text)
    assert content == "GLM writes <tool_call> tags\nin prose. Now:\n"
    # a string exactly as written; "007" is no JSON number and Python 3 reads no such literal: text, as vLLM leaves
    # it (stripped); NaN has no JSON form
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"s": " 007 ", "n": "007", "x": "NaN"})]
