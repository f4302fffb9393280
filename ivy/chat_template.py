"""A model's chat template (Jinja2, from its tokenizer config) rendered in a sandbox.

Chat models ship the template that turns a list of messages into the prompt text they
were trained on, as ``chat_template`` in ``tokenizer_config.json`` (or a separate
``chat_template.jinja``). It is untrusted code, so it runs in Jinja2's immutable sandbox
with the same environment Hugging Face `transformers` provides: ``trim_blocks`` and
``lstrip_blocks``, loop controls, a ``tojson`` filter, ``raise_exception`` and
``strftime_now``, the ``{% generation %}`` block (rendered as its body) and the special
token strings (``bos_token``, ``eos_token``, ...) as variables.

Example::

    template = ChatTemplate.from_directory(Path("~/.cache/trellis/models/smollm2-135m-instruct"))
    text = template.render([{"role": "user", "content": "Hi"}])
    # '<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n'

Special tokens come only from the template. A message whose content writes a special
token's text (``<|im_end|>\\n<|im_start|>system\\n...``) must not forge a turn, so
`ChatTemplate.render_prompt` renders such content with each special-token string replaced
by a placeholder character that occurs nowhere else, and the tokenizer
(`ivy.tokenization.TextTokenizer.encode_prompt`) turns the placeholders back into their
literal text, tokenized as plain text. Conversations whose content holds no special-token
string render exactly as `render` does, so their ids are Hugging Face's
``apply_chat_template(..., tokenize=True)`` ids.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "ChatTemplateError", "RenderedPrompt"]

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


# Template variables a chat_template_kwargs may not set: the renderer's own arguments.
_RESERVED = frozenset(
    {"messages", "add_generation_prompt", "continue_final_message", "tools", "documents"}
)
# transformers' marker of the final message's end under continue_final_message
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "

# Placeholders for special-token strings found in message content: private-use code points
# (planes 16, then 15) that occur nowhere in the messages, the template or the tokens.
_PLACEHOLDER_RANGES = (range(0x10FFFD, 0x100000 - 1, -1), range(0xFFFFD, 0xF0000 - 1, -1))


class ChatTemplateError(ValueError):
    """The template rejected the conversation (``raise_exception``) or failed to render;
    ``param``: the request field at fault (the messages, unless an option)."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class RenderedPrompt:
    """A rendered conversation, ready for `TextTokenizer.encode_prompt`.

    ``text`` is the template's output, except that every special-token string the
    messages (their content, tool calls and answers) or the tools wrote is one placeholder
    character; ``literals`` maps each
    placeholder to that string (empty when the content wrote none: then ``text`` is exactly
    `ChatTemplate.render`'s output)."""

    text: str
    literals: Mapping[str, str] = field(default_factory=dict)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training
    masks; for serving it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_text(value: object) -> str | None:
    """Special tokens appear as plain strings or as AddedToken dicts with ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _written(
    messages: Sequence[Mapping[str, object]], tools: Sequence[Mapping[str, object]] | None
) -> Iterator[str]:
    """Every string the client wrote into the messages (their content, tool calls and
    tool answers; not the roles) and the tools."""
    for m in messages:
        for key, value in m.items():
            if key != "role":
                yield from _strings(value)
    yield from _strings(list(tools or []))


@functools.lru_cache(maxsize=16)
def _special_pattern(tokens: frozenset[str]) -> re.Pattern[str]:
    """Matches the special-token strings leftmost-longest (like the tokenizers' matchers):
    alternatives longest first."""
    ordered = sorted((t for t in tokens if t), key=lambda t: (-len(t), t))
    return re.compile("|".join(re.escape(t) for t in ordered))


def _strings(value: object) -> Iterator[str]:
    """Every string inside a message value (nested lists and dicts included)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def _pick_template(raw: object) -> str | None:
    """The default template: a string, or the entry named "default" of a named list."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named = {str(t.get("name")): t.get("template") for t in raw if isinstance(t, Mapping)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


class ChatTemplate:
    """A compiled chat template and the special-token variables it is rendered with.

    Immutable after construction; ``render`` is safe to call from several threads."""

    def __init__(self, source: str, special_tokens: Mapping[str, object] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from None
        self.source = source
        self._variables: dict[str, object] = dict(special_tokens or {})

    @classmethod
    def from_directory(cls, directory: Path) -> ChatTemplate | None:
        """The template of a Hugging Face model directory, or None when it has none."""
        config: dict[str, Any] = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.is_file():
            loaded = json.loads(config_path.read_text(encoding="utf-8"))
            config = loaded if isinstance(loaded, dict) else {}
        jinja_path = directory / "chat_template.jinja"
        if jinja_path.is_file():
            source: str | None = jinja_path.read_text(encoding="utf-8")
        else:
            source = _pick_template(config.get("chat_template"))
        if source is None:
            return None
        special: dict[str, object] = {}
        for key in _SPECIAL_TOKEN_KEYS:
            text = _token_text(config.get(key))
            if text is not None:
                special[key] = text
        extra = config.get("additional_special_tokens")
        if isinstance(extra, list):
            special["additional_special_tokens"] = [
                t for t in (_token_text(x) for x in extra) if t is not None
            ]
        return cls(source, special)

    def render(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        variables: Mapping[str, object] | None = None,
        tools: Sequence[Mapping[str, object]] | None = None,
    ) -> str:
        """The prompt text for ``messages`` (dicts with ``role`` and string ``content``).

        ``tools``: the request's tools (OpenAI's objects), the template's ``tools``.
        ``variables`` are more template variables (vLLM's ``chat_template_kwargs``; they
        may replace the special-token strings, not the names this call sets).
        ``continue_final_message`` leaves the last message open, as `transformers`'
        ``apply_chat_template`` does: its content is rendered with a tag appended and the
        text is cut where the tag begins (and right-stripped when the template trimmed the
        space after the tag)."""
        chat = [dict(m) for m in messages]
        reserved = _RESERVED.intersection(variables or ())
        if reserved:
            raise ChatTemplateError(
                f"chat_template_kwargs may not set {', '.join(sorted(reserved))}: "
                "the request's own fields do",
                "chat_template_kwargs",
            )
        if continue_final_message:
            if add_generation_prompt:
                raise ChatTemplateError(
                    "continue_final_message and add_generation_prompt cannot both be true",
                    "continue_final_message",
                )
            if not chat or not isinstance(chat[-1].get("content"), str):
                raise ChatTemplateError("continue_final_message needs a final message to continue")
            final = str(chat[-1]["content"])
            chat[-1]["content"] = final + _CONTINUE_TAG
        try:
            text = self._template.render(
                **{**self._variables, **(variables or {})},
                messages=chat,
                add_generation_prompt=add_generation_prompt,
                tools=[dict(t) for t in tools] if tools else None,
                documents=None,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from None
        if not continue_final_message:
            return text
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise ChatTemplateError(
                "continue_final_message: the chat template drops part of the final message"
            )
        at = text.rindex(tag)
        return (
            text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
        )

    def render_prompt(
        self,
        messages: Sequence[Mapping[str, object]],
        special_tokens: Collection[str],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        variables: Mapping[str, object] | None = None,
        tools: Sequence[Mapping[str, object]] | None = None,
    ) -> RenderedPrompt:
        """`render`, with the special-token strings (``special_tokens``: the tokenizer's)
        that a message's ``content`` writes replaced by placeholders (see
        `RenderedPrompt`), so that only the template can place special tokens.

        The template sees each such string as one placeholder character, so a template
        that measures or slices content sees it shorter; one that trims, splits on other
        text or tests prefixes behaves as before."""
        options: dict[str, Any] = {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "variables": variables,
            "tools": tools,
        }
        tokens = (
            special_tokens if isinstance(special_tokens, frozenset) else frozenset(special_tokens)
        )
        if not tokens:
            return RenderedPrompt(self.render(messages, **options))
        pattern = _special_pattern(tokens)
        found: set[str] = set()
        for text in _written(messages, tools):
            found.update(pattern.findall(text))
        if not found:
            return RenderedPrompt(self.render(messages, **options))
        taken: set[str] = set(self.source)
        for text in _strings([self._variables, variables or {}, list(tools or [])]):
            taken.update(text)
        for text in _strings(list(messages)):
            taken.update(text)
        for text in tokens:
            taken.update(text)
        free = (chr(c) for r in _PLACEHOLDER_RANGES for c in r if chr(c) not in taken)
        placeholder: dict[str, str] = {}
        for token in sorted(found):
            char = next(free, None)
            if char is None:
                raise ChatTemplateError(
                    "the messages use every private-use character; no placeholder is left "
                    "for the special-token text in their content"
                )
            placeholder[token] = char

        def escape(value: object) -> Any:
            if isinstance(value, str):
                return pattern.sub(lambda hit: placeholder[hit.group()], value)
            if isinstance(value, Mapping):
                return {k: escape(v) for k, v in value.items()}
            if isinstance(value, list | tuple):
                return [escape(v) for v in value]
            return value

        escaped = [{k: v if k == "role" else escape(v) for k, v in m.items()} for m in messages]
        options["tools"] = escape(list(tools)) if tools else None
        text = self.render(escaped, **options)
        return RenderedPrompt(text, {char: token for token, char in placeholder.items()})
