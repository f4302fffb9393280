"""A reasoning model's thought split from its answer (`ivy.reasoning`), as vLLM's reasoning
parsers split Qwen3's and DeepSeek-R1's: whole answers, and streamed ones at every chunk
size (the same split, nothing of a tag leaked as it forms)."""

from __future__ import annotations

import pytest

from ivy.reasoning import Thoughts, ThoughtStream

HYBRID = Thoughts(in_thought=False)  # Qwen3: the answer may open a thought
OPENED = Thoughts(in_thought=True)  # R1's distills: the prompt opened it


def test_only_templates_that_write_the_end_tag_reason() -> None:
    assert Thoughts.for_prompt("{{ messages }}", "<|im_start|>assistant\n") is None
    template = "{%- if x %}<think>\n\n</think>\n\n{%- endif %}"
    assert Thoughts.for_prompt(template, "<|im_start|>assistant\n") == HYBRID
    assert Thoughts.for_prompt(template, "<｜Assistant｜><think>\n") == OPENED


@pytest.mark.parametrize(
    ("thoughts", "answer", "want"),
    [
        (HYBRID, "<think>\nPlan.\n</think>\n\nParis.", ("\nPlan.\n", "\n\nParis.")),
        (HYBRID, "\n<think>a</think>b", ("a", "b")),
        (HYBRID, "Paris.", (None, "Paris.")),
        (HYBRID, "Paris. <think>no</think>", (None, "Paris. <think>no</think>")),
        (HYBRID, "", (None, "")),
        (HYBRID, "<think>cut short", ("cut short", None)),
        (HYBRID, "<think>a</think>", ("a", None)),
        (OPENED, "Plan.\n</think>\n\nParis.", ("Plan.\n", "\n\nParis.")),
        (OPENED, "Plan, cut short", ("Plan, cut short", None)),
        (OPENED, "</think>Paris.", ("", "Paris.")),
        (OPENED, "a</think>b</think>c", ("a", "b</think>c")),
    ],
)
def test_split(thoughts: Thoughts, answer: str, want: tuple[str | None, str | None]) -> None:
    assert thoughts.split(answer) == want
    for cut in (1, 2, 3, 7):  # streamed: the same text, on the same side of the split
        stream = ThoughtStream(thoughts)
        reasoning, content = "", ""
        for i in range(0, len(answer), cut):
            r, c = stream.feed(answer[i : i + cut])
            reasoning, content = reasoning + r, content + c
        r, c = stream.finish()
        reasoning, content = reasoning + r, content + c
        want_reasoning, want_content = want
        assert reasoning == (want_reasoning or "")
        assert content == (want_content or "")


def test_a_forming_tag_is_held_and_released() -> None:
    stream = ThoughtStream(HYBRID)
    assert stream.feed(" <thi") == ("", "")  # may still open a thought
    assert stream.feed("nk>Plan") == ("Plan", "")
    assert stream.feed(" </th") == (" ", "")  # may still close it
    assert stream.feed("ought>") == ("</thought>", "")  # it did not
    assert stream.feed("</think>Paris") == ("", "Paris")
    assert stream.feed(" <think>") == ("", " <think>")  # after the thought: content
    other = ThoughtStream(HYBRID)
    assert other.feed("<th") == ("", "")
    assert other.feed("e answer") == ("", "<the answer")  # no thought after all


def test_a_thought_left_out_is_not_returned() -> None:
    """vLLM's include_reasoning false: the thought is dropped, the content stays."""
    hidden = Thoughts(in_thought=False, shown=False)
    assert hidden.split("<think>Plan</think>Paris") == (None, "Paris")
    assert hidden.split("Paris") == (None, "Paris")
    stream = ThoughtStream(hidden)
    assert stream.feed("<think>Pl") == ("", "")
    assert stream.feed("an</think>Par") == ("", "Par")
    assert stream.finish() == ("", "")
    cut = ThoughtStream(Thoughts(in_thought=True, shown=False))
    assert (cut.feed("Plan"), cut.finish()) == (("", ""), ("", ""))
