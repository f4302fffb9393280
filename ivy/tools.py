"""OpenAI tool calling on chat completions, over the model's own chat template.

The request's ``tools`` reach the model through its chat template (the ``tools``
variable, as `transformers` and vLLM pass them); earlier calls and their answers travel in
the messages (``tool_calls``, role ``tool``). What comes back is read by ``tool_choice``:

- ``auto``: the model answers or calls. Calls are read in the format the template writes
  (`CallFormat`, known by a marker in its source), as vLLM's parser of that name reads them;
  an answer whose calls do not parse is content:
  - ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` anywhere in the
    answer (Qwen2.5, Qwen3, Hermes and the templates built on them); the text before the
    first call is the content.
  - ``llama3_json``: an answer that is one or more ``{"name": ..., "parameters": {...}}``
    objects (``arguments`` also read), joined by ``;``, optionally after ``<|python_tag|>``
    (Llama 3.1-3.3, whose templates give tool results the ``ipython`` role); a call is the
    whole answer or nothing.
  - ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": {...}}``
    (Mistral 7B v0.3, Nemo, Small); the text before it is the content. ``[TOOL_CALLS]`` is
    a special token, left out of the decoded text, so an answer that is such a list alone
    is read as calls too.
- ``required``: the answer is held, token by token (`rose.grammar`), to a JSON list of
  ``{"name", "parameters"}`` over the tools (vLLM's schema), read as calls.
- a named function: the answer is held to that function's parameter schema; it is the
  call's arguments.
- ``none``: the tools are shown, the answer is content.

Invariants: a plan exists only for a template that takes ``tools``; ``auto`` only for one
that writes a known format (otherwise a 400 says to use ``required`` or a named
function); a held answer (required, named) is never also held to a ``response_format``.
Streamed, content is sent as it comes except text that may start a call, and a call is
sent when its text is complete (a named call's arguments as they come).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ivy.chat_template import ChatTemplate
from ivy.errors import ValidationError
from ivy.generation_schemas import (
    ChatCompletionRequest,
    FunctionCallDelta,
    FunctionCallOut,
    NamedToolChoice,
    ToolCallDelta,
    ToolCallOut,
)
from ivy.reasoning import split_at_tag
from ivy.schemas import Tool

__all__ = [
    "FORMATS",
    "CallFormat",
    "ToolPlan",
    "ToolStream",
    "parse_hermes",
    "parse_llama3_json",
    "parse_mistral",
    "plan_tools",
    "template_tools",
]

_START = "<tool_call>"
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)$", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_CALLS = "[TOOL_CALLS]"
_LLAMA3_STARTS = ("{", _PYTHON_TAG)

Calls = list[tuple[str, str]]  # (name, arguments JSON)


class CallFormat:
    """How a model writes tool calls in its answers: known by ``marker`` in its chat
    template's source; `parse` reads a whole answer, `split` a stream's held text."""

    name: str
    marker: str

    def parse(self, text: str) -> tuple[str | None, Calls] | None:
        """(content, calls) of an answer with calls; None when it has none, or one does
        not parse (then it is all content)."""
        raise NotImplementedError

    def split(self, held: str, began: bool) -> tuple[str, str, bool]:
        """A streamed answer's text not yet sent → (content to send now, text to hold,
        whether a call has started in the held text); ``began``: content other than
        whitespace was sent already."""
        raise NotImplementedError


class _Hermes(CallFormat):
    name = "hermes"
    marker = _START

    def parse(self, text: str) -> tuple[str | None, Calls] | None:
        return parse_hermes(text)

    def split(self, held: str, began: bool) -> tuple[str, str, bool]:
        return split_at_tag(held, _START)


class _Llama3Json(CallFormat):
    name = "llama3_json"
    # Llama 3.1-3.3's templates give tool results their own role, under this header
    marker = "<|start_header_id|>ipython<|end_header_id|>"

    def parse(self, text: str) -> tuple[str | None, Calls] | None:
        return parse_llama3_json(text)

    def split(self, held: str, began: bool) -> tuple[str, str, bool]:
        if began:  # an answer that began as text is content to its end
            return held, "", False
        body = held.lstrip()
        if body.startswith(_LLAMA3_STARTS):
            return "", held, True
        if not body or any(start.startswith(body) for start in _LLAMA3_STARTS):
            return "", held, False  # whitespace, or what may begin <|python_tag|>
        return held, "", False


class _MistralJson(CallFormat):
    name = "mistral"
    marker = _MISTRAL_CALLS

    def parse(self, text: str) -> tuple[str | None, Calls] | None:
        return parse_mistral(text)

    def split(self, held: str, began: bool) -> tuple[str, str, bool]:
        if not began:  # the tag itself decodes to nothing: a list alone may be the calls
            body = held.lstrip()
            if body.startswith("["):
                return "", held, True
            if not body:
                return "", held, False
        return split_at_tag(held, _MISTRAL_CALLS)


FORMATS: tuple[CallFormat, ...] = (_Hermes(), _Llama3Json(), _MistralJson())
"""The call formats `auto` reads, in the order templates are matched against them."""


@dataclass(frozen=True)
class ToolPlan:
    """How one request's answer is read: ``mode`` is auto, required, named or none."""

    mode: str
    tools: list[dict[str, Any]]  # as the chat template sees them
    name: str | None = None  # the named function
    parallel: bool = True  # false: at most one call
    format: CallFormat = FORMATS[0]  # auto: how the model writes its calls

    def schema(self) -> dict[str, Any] | None:
        """The JSON Schema the answer is held to (None: free text)."""
        if self.mode == "named":
            return self._parameters(self.name)
        if self.mode != "required":
            return None
        options = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t["function"]["name"]]},
                    "parameters": self._parameters(t["function"]["name"]),
                },
                "required": ["name", "parameters"],
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def _parameters(self, name: str | None) -> dict[str, Any]:
        spec = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return spec.get("parameters") or {"type": "object"}

    def read(self, text: str, finish: str) -> tuple[str | None, list[ToolCallOut], str]:
        """An answer's (content, calls, finish reason) under this plan."""
        if self.mode == "named":
            assert self.name is not None
            return None, [_call(self.name, text)], finish
        calls: Calls | None = None
        content: str | None = text
        if self.mode == "required":
            calls = _required_calls(text)
            content = None
        elif self.mode == "auto":
            parsed = self.format.parse(text)
            if parsed is not None:
                content, calls = parsed
        if not calls:
            return text, [], finish
        if not self.parallel:
            calls = calls[:1]
        out = [_call(name, arguments) for name, arguments in calls]
        return content, out, "tool_calls" if finish == "stop" else finish


def plan_tools(req: ChatCompletionRequest, template: ChatTemplate) -> ToolPlan | None:
    """The request's tool plan (None: no tools), checked against the model's template."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise ValidationError("tool_choice needs `tools`.", param="tool_choice")
        return None
    tools = template_tools(req.tools, template, req.model)
    names = [t["function"]["name"] for t in tools]
    parallel = req.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise ValidationError(
                f"tool_choice names `{choice.function.name}`, which is not among the tools.",
                param="tool_choice",
            )
        plan = ToolPlan("named", tools, choice.function.name, parallel)
    else:
        plan = ToolPlan(choice or "auto", tools, None, parallel)
    if plan.mode == "auto":
        known = next((f for f in FORMATS if f.marker in template.source), None)
        if known is None:
            raise ValidationError(
                f"The model `{req.model}`'s chat template writes tool calls in a format "
                f"Trellis does not read (it reads {', '.join(f.name for f in FORMATS)}); "
                "send tool_choice `required` or a named function, whose answers are held "
                "to the tools' schemas.",
                param="tool_choice",
            )
        plan = replace(plan, format=known)
    if plan.mode in ("named", "required") and req.response_format is not None:
        if req.response_format.type != "text":
            raise ValidationError(
                "response_format cannot be used with tool_choice `required` or a named "
                "function (the call's schema holds the answer).",
                param="response_format",
            )
    for name in ("ignore_eos", "min_tokens"):
        if plan.mode in ("named", "required") and getattr(req, name):
            raise ValidationError(
                f"{name} cannot be used with tool_choice `required` or a named function "
                "(the call's schema ends the answer).",
                param=name,
            )
    if plan.mode != "none" and req.logprobs:
        raise ValidationError(
            "logprobs are not returned with tool calls; send tool_choice `none` or no logprobs.",
            param="logprobs",
        )
    return plan


def template_tools(
    tools: Sequence[Tool], template: ChatTemplate, model: str
) -> list[dict[str, Any]]:
    """The request's tools as the chat template sees them (OpenAI's objects), refused
    (400 naming `tools`) when their names repeat or the template takes no tools."""
    out = [t.model_dump(exclude_none=True) for t in tools]
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise ValidationError("Tool names must be unique.", param="tools")
    if "tools" not in template.source:
        raise ValidationError(
            f"The model `{model}`'s chat template does not take tools.", param="tools"
        )
    return out


def parse_hermes(text: str) -> tuple[str | None, Calls] | None:
    """(content, [(name, arguments JSON)]) of an answer with Hermes tool calls, None when
    it has none or one does not parse (then it is all content), as vLLM's hermes parser:
    the content is the text before the first call (None when empty), a last call may be
    unclosed, ``arguments`` are re-serialized (``ensure_ascii=False``)."""
    if _START not in text:
        return None
    calls = []
    for match in _CALL.finditer(text):
        body = match.group(1) if match.group(1) is not None else match.group(2)
        try:
            call = json.loads(body)
        except ValueError:
            return None
        read = _read_call(call, "arguments")
        if read is None:
            return None
        calls.append(read)
    content = text[: text.index(_START)]
    return (content or None), calls


def parse_llama3_json(text: str) -> tuple[str | None, Calls] | None:
    """(None, [(name, arguments JSON)]) of an answer that is Llama 3 JSON calls, None
    otherwise (it is all content), as vLLM's ``llama3_json`` parser: after optional
    whitespace and ``<|python_tag|>``, JSON objects with a ``name`` and ``parameters`` (or
    ``arguments``), joined by ``;``, and nothing else; ``arguments`` are re-serialized
    (``ensure_ascii=False``)."""
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG) :].lstrip()
    if not body.startswith("{"):
        return None
    decoder = json.JSONDecoder()
    calls: Calls = []
    at = 0
    while True:
        try:
            call, at = decoder.raw_decode(body, at)
        except ValueError:
            return None
        read = _read_call(call, "arguments", "parameters")
        if read is None:
            return None
        calls.append(read)
        rest = body[at:].lstrip()
        if not rest:
            return None, calls
        if not rest.startswith(";"):
            return None  # text after a call: the answer is content
        at = len(body) - len(rest[1:].lstrip())


def parse_mistral(text: str) -> tuple[str | None, Calls] | None:
    """(content, [(name, arguments JSON)]) of an answer with Mistral tool calls, None when
    it has none or they do not parse (then it is all content), as vLLM's ``mistral``
    parser: the text before ``[TOOL_CALLS]`` is the content (None when empty), after it a
    JSON list of calls with a ``name`` and ``arguments``. Without the tag (a special
    token, decoded to nothing) the answer must be such a list alone."""
    content: str | None = None
    body = text
    if _MISTRAL_CALLS in text:
        at = text.index(_MISTRAL_CALLS)
        content, body = text[:at] or None, text[at + len(_MISTRAL_CALLS) :]
    try:
        items = json.loads(body)
    except ValueError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls: Calls = []
    for call in items:
        read = _read_call(call, "arguments", "parameters")
        if read is None:
            return None
        calls.append(read)
    return content, calls


def _read_call(call: object, *keys: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a parsed call: an object with a string ``name``, its
    arguments under the first of ``keys`` it has ({} when none), re-serialized
    (``ensure_ascii=False``); None for anything else."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = next((call[k] for k in keys if k in call), {})
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def _required_calls(text: str) -> Calls | None:
    try:
        items = json.loads(text)
        return [(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]
    except (ValueError, TypeError, KeyError):
        return None  # cut short (length): the text is the answer


def _call(name: str, arguments: str) -> ToolCallOut:
    return ToolCallOut(f"call_{uuid.uuid4().hex[:24]}", FunctionCallOut(name, arguments))


@dataclass
class ToolStream:
    """One streamed choice under a plan: `feed` each text piece, `finish` at the end; each
    returns (content to send now, tool-call deltas to send now)."""

    plan: ToolPlan
    _held: str = ""  # auto: text that may start a call; required: the whole answer
    _calling: bool = False  # auto: a call has started (the rest is held)
    _began: bool = False  # auto: content other than whitespace was sent
    _named: ToolCallOut | None = None  # named: the call, once its first piece is sent

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        mode = self.plan.mode
        if mode == "none" or not text:
            return text, []
        if mode == "named":
            if self._named is None:
                self._named = _call(self.plan.name or "", "")
                first = ToolCallDelta(
                    0,
                    FunctionCallDelta(self._named.function.name, text),
                    self._named.id,
                    "function",
                )
                return "", [first]
            return "", [ToolCallDelta(0, FunctionCallDelta(None, text))]
        self._held += text
        if mode == "required" or self._calling:
            return "", []
        content, self._held, self._calling = self.plan.format.split(self._held, self._began)
        self._began = self._began or bool(content.strip())
        return content, []

    def finish(self, reason: str) -> tuple[str, list[ToolCallDelta], str]:
        """The rest of the choice: (content, deltas, finish reason)."""
        mode = self.plan.mode
        if mode in ("none", "named"):
            return "", [], reason
        held, self._held = self._held, ""
        if mode == "auto" and not self._calling:
            return held, [], reason
        _, calls, reason = self.plan.read(held, reason)
        if not calls:
            return held, [], reason
        return "", [_delta(i, c) for i, c in enumerate(calls)], reason


def _delta(index: int, call: ToolCallOut) -> ToolCallDelta:
    return ToolCallDelta(
        index, FunctionCallDelta(call.function.name, call.function.arguments), call.id, "function"
    )
