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
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "ChatTemplateError"]

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


class ChatTemplateError(ValueError):
    """The template rejected the conversation (``raise_exception``) or failed to render."""


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
        self, messages: Sequence[Mapping[str, object]], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for ``messages`` (dicts with ``role`` and string ``content``)."""
        try:
            return self._template.render(
                **self._variables,
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from None
