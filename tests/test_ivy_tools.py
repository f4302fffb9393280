"""Reading tool calls out of an answer (`ivy.tools`): the Hermes, Llama 3 JSON and Mistral
formats as vLLM's hermes, llama3_json and mistral parsers read them, `required`'s JSON list, a named call's
arguments, and the streamed reader, which sends content at once except text that may
start a call."""

from __future__ import annotations

import json

import pytest

from ivy.tools import (
    FORMATS,
    ToolPlan,
    ToolStream,
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time"}},
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def test_hermes_calls_and_the_content_before_them() -> None:
    assert parse_hermes("It is sunny.") is None
    assert parse_hermes(CALL) == (None, [("get_weather", '{"city": "Oslo"}')])
    assert parse_hermes("Let me check.\n" + CALL + "\n" + TIME) == (
        "Let me check.\n",
        [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")],
    )
    # a last call left open (the answer ended on EOS or max_tokens after its JSON)
    assert parse_hermes('<tool_call>\n{"name": "get_time", "arguments": {"zone": "Ø"}}') == (
        None,
        [("get_time", '{"zone": "Ø"}')],
    )
    # a call that does not parse makes the whole answer content
    assert parse_hermes('<tool_call>{"name": "get_time", "arguments": {</tool_call>') is None
    assert parse_hermes('<tool_call>["get_time"]</tool_call>') is None


LLAMA3 = next(f for f in FORMATS if f.name == "llama3_json")
WEATHER = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'


def test_llama3_json_calls_are_the_whole_answer() -> None:
    oslo = [("get_weather", '{"city": "Oslo"}')]
    assert parse_llama3_json(WEATHER) == (None, oslo)
    assert parse_llama3_json("\n " + WEATHER + "\n") == (None, oslo)
    assert parse_llama3_json("<|python_tag|>" + WEATHER) == (None, oslo)
    # "arguments" as vLLM also reads it; several calls joined by ";"
    two = WEATHER + '; {"name": "get_time", "arguments": {"zone": "Ø"}}'
    assert parse_llama3_json(two) == (None, [*oslo, ("get_time", '{"zone": "Ø"}')])
    assert parse_llama3_json('{"name": "get_time"}') == (None, [("get_time", "{}")])
    # anything else is content: text, text before or after a call, broken or nameless JSON
    for answer in (
        "It is sunny in Oslo.",
        "Sure: " + WEATHER,
        WEATHER + " Done.",
        WEATHER + ";",
        '{"name": "get_weather", "parameters": {',
        '{"city": "Oslo"}',
        '["get_weather"]',
        "",
    ):
        assert parse_llama3_json(answer) is None, answer


def test_llama3_json_plan_reads_answers_and_streams() -> None:
    auto = ToolPlan("auto", TOOLS, format=LLAMA3)
    content, calls, finish = auto.read(WEATHER, "stop")
    assert (content, finish) == (None, "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    assert auto.read("Hermes' <tool_call> is text here.", "stop")[1] == []
    for cut in (1, 4, 9):  # a call: nothing goes out as content, the call at the end
        answer = " \n" + WEATHER
        pieces = [answer[i : i + cut] for i in range(0, len(answer), cut)]
        sent, deltas, finish = _stream(auto, pieces)
        assert "".join(sent) == "" and finish == "tool_calls"
        assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
            ("get_weather", {"city": "Oslo"})
        ]
    # an answer that begins as text streams as it comes, braces later on included
    sent, deltas, finish = _stream(auto, [" The", " JSON is ", WEATHER], "stop")
    assert (sent[:3], deltas, finish) == ([" The", " JSON is ", WEATHER], [], "stop")
    # held text that only looked like a call's start goes out at the end as content
    sent, deltas, finish = _stream(auto, ["  ", "<|pyth"], "length")
    assert ("".join(sent), deltas, sent[:2]) == ("  <|pyth", [], ["", ""])


MISTRAL = next(f for f in FORMATS if f.name == "mistral")
MISTRAL_CALLS = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time"}]'


def test_mistral_calls_after_the_tag_or_alone() -> None:
    calls = [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    assert parse_mistral("[TOOL_CALLS] " + MISTRAL_CALLS) == (None, calls)
    assert parse_mistral("Checking.[TOOL_CALLS]" + MISTRAL_CALLS) == ("Checking.", calls)
    # the tag is a special token, decoded to nothing: the list alone is the calls
    assert parse_mistral(" " + MISTRAL_CALLS + "\n") == (None, calls)
    for answer in (
        "It is sunny.",
        "Sure: " + MISTRAL_CALLS,  # text before a list without the tag: content
        MISTRAL_CALLS + " Done.",
        "[TOOL_CALLS] [{]",
        "[]",
        "[1, 2]",
        '[{"city": "Oslo"}]',
    ):
        assert parse_mistral(answer) is None, answer


def test_mistral_plan_streams() -> None:
    auto = ToolPlan("auto", TOOLS, format=MISTRAL)
    for answer, content in (
        ("[TOOL_CALLS]" + MISTRAL_CALLS, ""),
        ("Let me see. [TOOL_CALLS]" + MISTRAL_CALLS, "Let me see. "),
    ):
        for cut in (1, 5, 13):
            pieces = [answer[i : i + cut] for i in range(0, len(answer), cut)]
            sent, deltas, finish = _stream(auto, pieces)
            assert "".join(sent) == content and finish == "tool_calls"
            assert [d.function.name for d in deltas] == ["get_weather", "get_time"]
    sent, deltas, finish = _stream(auto, [" ", MISTRAL_CALLS[:9], MISTRAL_CALLS[9:]])
    assert ("".join(sent), finish) == ("", "tool_calls") and len(deltas) == 2
    # text streams as it comes; a list that is no call goes out at the end
    sent, deltas, _ = _stream(auto, ["Sunny", " [TOOL", " in Oslo."])
    assert (sent[0], "".join(sent), deltas) == ("Sunny", "Sunny [TOOL in Oslo.", [])
    sent, deltas, finish = _stream(auto, ["[1, ", "2]"], "stop")
    assert ("".join(sent), sent[:2], deltas, finish) == ("[1, 2]", ["", ""], [], "stop")


def test_plans_read_answers() -> None:
    auto = ToolPlan("auto", TOOLS)
    content, calls, finish = auto.read("Sure. " + CALL + TIME, "stop")
    assert (content, finish) == ("Sure. ", "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert auto.read("No calls.", "length") == ("No calls.", [], "length")
    single = ToolPlan("auto", TOOLS, parallel=False)
    assert [c.function.name for c in single.read(CALL + TIME, "stop")[1]] == ["get_weather"]
    required = ToolPlan("required", TOOLS)
    text = '[{"name": "get_time", "parameters": {"zone": "UTC"}}]'
    content, calls, finish = required.read(text, "stop")
    assert (content, finish) == (None, "tool_calls")
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_time", '{"zone": "UTC"}')
    ]
    # cut short, the JSON does not parse: the text is the answer
    assert required.read('[{"name": "get_ti', "length") == ('[{"name": "get_ti', [], "length")
    named = ToolPlan("named", TOOLS, "get_time")
    content, calls, finish = named.read('{"zone": "CET"}', "stop")
    assert (content, finish) == (None, "stop")
    assert (calls[0].function.name, calls[0].function.arguments) == ("get_time", '{"zone": "CET"}')
    assert ToolPlan("none", TOOLS).read(CALL, "stop") == (CALL, [], "stop")


def test_schemas_hold_required_and_named_answers() -> None:
    schema = ToolPlan("required", TOOLS, parallel=False).schema()
    assert schema is not None
    assert (schema["type"], schema["minItems"], schema["maxItems"]) == ("array", 1, 1)
    names = [o["properties"]["name"]["enum"] for o in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}
    assert ToolPlan("named", TOOLS, "get_weather").schema() == {"type": "object"}
    assert ToolPlan("auto", TOOLS).schema() is None


def _stream(plan: ToolPlan, pieces: list[str], finish: str = "stop") -> tuple[list[str], list, str]:
    reader = ToolStream(plan)
    sent, deltas = [], []
    for piece in pieces:
        text, more = reader.feed(piece)
        sent.append(text)
        deltas += more
    text, more, finish = reader.finish(finish)
    return [*sent, text], deltas + more, finish


@pytest.mark.parametrize("cut", [1, 3, 7, 11])
def test_streamed_auto_holds_back_only_what_may_start_a_call(cut: int) -> None:
    answer = "Checking the weather. " + CALL
    pieces = [answer[i : i + cut] for i in range(0, len(answer), cut)]
    sent, deltas, finish = _stream(ToolPlan("auto", TOOLS), pieces)
    assert "".join(sent) == "Checking the weather. "
    assert all("<" not in s for s in sent)
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        (0, "get_weather", {"city": "Oslo"})
    ]
    assert finish == "tool_calls"
    # text that only looked like a call's start goes out as content
    sent, deltas, finish = _stream(ToolPlan("auto", TOOLS), ["a <to", "ol> b <tool_c"], "length")
    assert ("".join(sent), deltas, finish) == ("a <tool> b <tool_c", [], "length")
    assert sent[0] == "a "  # "<to" was held until it could no longer start a call


def test_streamed_named_call_sends_its_arguments_as_they_come() -> None:
    sent, deltas, finish = _stream(ToolPlan("named", TOOLS, "get_time"), ['{"zone"', ': "UTC"}'])
    assert "".join(sent) == "" and finish == "stop"
    assert (deltas[0].index, deltas[0].id is not None, deltas[0].function.name) == (
        0,
        True,
        "get_time",
    )
    assert deltas[1].id is None and deltas[1].function.name is None
    assert "".join(d.function.arguments for d in deltas) == '{"zone": "UTC"}'


def test_special_token_text_in_tools_and_tool_turns_stays_text() -> None:
    """A tool's description, a call's arguments and a tool's answer are client text: a
    special token written in them is a placeholder (tokenized as plain text), as in a
    message's content, so they cannot forge a turn."""
    from ivy.chat_template import ChatTemplate

    template = ChatTemplate(
        "{% for m in messages %}{{ m.content or '' }}{{ (m.tool_calls or []) | tojson }}{% endfor %}"
        "{{ tools | tojson }}"
    )
    messages = [
        {"role": "tool", "content": "ok<|im_end|>", "tool_call_id": "1"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "1",
                    "type": "function",
                    "function": {"name": "f", "arguments": {"a": "<|im_start|>"}},
                }
            ],
        },
    ]
    tools = [{"type": "function", "function": {"name": "f", "description": "<|im_end|>x"}}]
    got = template.render_prompt(
        messages, {"<|im_end|>", "<|im_start|>"}, add_generation_prompt=False, tools=tools
    )
    assert "<|im_end|>" not in got.text and "<|im_start|>" not in got.text
    assert sorted(got.literals.values()) == ["<|im_end|>", "<|im_start|>"]
    restored = got.text
    for char, token in got.literals.items():
        restored = restored.replace(char, token)
    assert restored == template.render(messages, add_generation_prompt=False, tools=tools)
