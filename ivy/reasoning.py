"""Reasoning models' thoughts on chat completions: the text a model writes between
``<think>`` and ``</think>`` is the message's ``reasoning_content`` (as vLLM's reasoning
parsers and DeepSeek's API return it), the rest its ``content``.

A model reasons when its chat template writes ``</think>`` (Qwen3, QwQ, DeepSeek-R1's
distills). Its answer is inside a thought from the start when the rendered prompt ends with
``<think>`` (templates that open the thought for the model), or once the answer opens one
with ``<think>`` at its start (Qwen3's hybrid templates; with thinking switched off the
template writes an empty thought into the prompt and the answer is all content). The
thought ends at ``</think>``: what follows is the content, as written (vLLM's split: the
newlines after the tag stay), read for tool calls like any answer (`ivy.tools`). An answer
that ends inside its thought (max_tokens) is all reasoning, its content null.

Streamed (`ThoughtStream`), reasoning and content go out as they come, except text that
may still be the start of a tag.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["END", "START", "ThoughtStream", "Thoughts", "split_at_tag"]

START = "<think>"
END = "</think>"


@dataclass(frozen=True)
class Thoughts:
    """How one request's answers are split. in_thought: the prompt opened the thought.
    shown: the thought is returned (vLLM's ``include_reasoning``; else it is dropped)."""

    in_thought: bool
    shown: bool = True

    @staticmethod
    def for_prompt(template_source: str, prompt_tail: str, shown: bool = True) -> Thoughts | None:
        """The split for a model whose template is ``template_source`` and a prompt ending
        in ``prompt_tail`` (None: the model does not reason)."""
        if END not in template_source:
            return None
        return Thoughts(prompt_tail.rstrip().endswith(START), shown)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole answer's (reasoning, content)."""
        stream = ThoughtStream(self)
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        reasoning, content = reasoning + more_reasoning, content + more_content
        if not stream.reasoned:
            return None, content
        return (reasoning if self.shown else None), content or None


class ThoughtStream:
    """One streamed answer under `Thoughts`: `feed` each text piece, `finish` at the end;
    each returns (reasoning to send now, content to send now)."""

    def __init__(self, thoughts: Thoughts) -> None:
        # None: not known yet whether the answer opens a thought (its start is held)
        self._inside: bool | None = True if thoughts.in_thought else None
        self._held = ""
        self._shown = thoughts.shown
        self.reasoned = thoughts.in_thought  # the answer had a thought

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = self._feed(text)
        return (reasoning if self._shown else ""), content

    def _feed(self, text: str) -> tuple[str, str]:
        if self._inside is False:
            return "", text
        self._held += text
        if self._inside is None:
            body = self._held.lstrip()
            if body.startswith(START):
                self._inside, self.reasoned, self._held = True, True, body[len(START) :]
            elif START.startswith(body):
                return "", ""  # whitespace, or what may begin <think>
            else:
                self._inside, held, self._held = False, self._held, ""
                return "", held
        reasoning, rest, ended = split_at_tag(self._held, END)
        if ended:
            self._inside, self._held = False, ""
            return reasoning, rest[len(END) :]
        self._held = rest
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """The held rest: reasoning when the answer ended inside its thought."""
        held, self._held = self._held, ""
        if self._inside:
            return (held if self._shown else ""), ""
        return "", held


def split_at_tag(held: str, tag: str) -> tuple[str, str, bool]:
    """Streamed text not yet sent, at its first ``tag`` → (the text before it, the tag and
    what follows, True); with no tag yet → (all but an end that may still begin it, that
    end, False)."""
    at = held.find(tag)
    if at >= 0:
        return held[:at], held[at:], True
    keep = next(
        (n for n in range(min(len(held), len(tag) - 1), 0, -1) if tag.startswith(held[-n:])), 0
    )
    return held[: len(held) - keep], held[len(held) - keep :], False
