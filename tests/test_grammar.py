"""Structured output masks (`rose.grammar`) on SmolLM2's real tokenizer: whatever the logits,
generation under the masks ends in JSON that `jsonschema` accepts; the masks of a draft pass
equal the masks of the same tokens fed one by one; a forbidden draft ends the valid rows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from rose.grammar import GrammarError, Grammars, JsonFormat

MODEL = "smollm2-135m-instruct"
VOCAB = 49152
EOS = 2  # <|im_end|>, what the chat model ends a turn with

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 24},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "tags": {"type": "array", "items": {"enum": ["search", "rag", "ml"]}, "maxItems": 3},
            "score": {"type": "number"},
        },
        "required": ["title", "year", "tags", "score"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "answer": {"type": "boolean"},
            "sources": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"id": {"type": "integer"}, "quote": {"type": "string"}},
                    "required": ["id"],
                    "additionalProperties": False,
                },
                "maxItems": 2,
            },
        },
        "required": ["answer", "sources"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    from rose.assets import ensure_model

    return Grammars(Path(ensure_model(MODEL)), VOCAB, [EOS])


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    from transformers import AutoTokenizer

    from rose.assets import ensure_model

    return AutoTokenizer.from_pretrained(str(ensure_model(MODEL)))


def _generate(
    grammars: Grammars,
    fmt: JsonFormat,
    seed: int,
    budget: int = 400,
    bias: torch.Tensor | None = None,
) -> list[int]:
    """Sample from random logits (+ ``bias [V]``) under the masks until the grammar accepts
    EOS."""
    gen = torch.Generator().manual_seed(seed)
    state = grammars.state(fmt)
    out: list[int] = []
    for _ in range(budget):
        logits = torch.randn(1, VOCAB, generator=gen) * 4
        if bias is not None:
            logits += bias
        state.mask_rows(logits)
        token = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
        state.accept([token])
        if token == EOS:
            assert state.finished
            return out
        out.append(token)
    raise AssertionError(f"no EOS within {budget} tokens")


@pytest.mark.parametrize("which", range(len(SCHEMAS)))
def test_masked_generation_always_validates(grammars: Grammars, tokenizer, which: int) -> None:  # noqa: ANN001
    schema = SCHEMAS[which]
    fmt = JsonFormat(json.dumps(schema))
    for seed in range(6):
        text = tokenizer.decode(_generate(grammars, fmt, seed))
        jsonschema.validate(json.loads(text), schema)  # raises if the masks let it stray


def test_json_object_gives_an_object(grammars: Grammars, tokenizer) -> None:  # noqa: ANN001
    # Free-form JSON has unbounded strings: favour tokens that close something, or a random
    # walk would wander inside a string for thousands of tokens.
    closes = [any(c in tokenizer.decode([t]) for c in '"]}') for t in range(VOCAB)]
    bias = torch.tensor(closes, dtype=torch.float32) * 8
    for seed in range(4):
        ids = _generate(grammars, JsonFormat(), seed, budget=2000, bias=bias)
        assert isinstance(json.loads(tokenizer.decode(ids)), dict)


def test_draft_rows_equal_one_token_at_a_time(grammars: Grammars, tokenizer) -> None:  # noqa: ANN001
    fmt = JsonFormat(json.dumps(SCHEMAS[0]))
    tokens = _generate(grammars, fmt, seed=11)
    start, drafts = tokens[:5], tokens[5:9]
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(len(drafts) + 1, VOCAB, generator=gen)

    one_by_one = grammars.state(fmt)
    one_by_one.accept(start)
    want = logits.clone()
    for i in range(len(drafts) + 1):
        one_by_one.mask_rows(want[i : i + 1])
        if i < len(drafts):
            one_by_one.accept([drafts[i]])

    state = grammars.state(fmt)
    state.accept(start)
    got = logits.clone()
    assert state.mask_rows(got, drafts) == len(drafts)
    assert torch.equal(got, want)
    # The state did not move: the next mask is the one after `start` again.
    again = logits[:1].clone()
    state.mask_rows(again)
    assert torch.equal(again, want[:1])
    assert (torch.isinf(want) & (want < 0)).any(dim=1).all()  # every row forbids something


def test_a_forbidden_draft_ends_the_valid_rows(grammars: Grammars, tokenizer) -> None:  # noqa: ANN001
    fmt = JsonFormat(json.dumps(SCHEMAS[0]))
    tokens = _generate(grammars, fmt, seed=12)
    state = grammars.state(fmt)
    state.accept(tokens[:3])
    forbidden = tokenizer("}}}", add_special_tokens=False)["input_ids"][0]
    drafts = [tokens[3], forbidden, tokens[5]]
    logits = torch.zeros(4, VOCAB)
    assert state.mask_rows(logits, drafts) == 1
    assert logits[1, forbidden] == float("-inf")  # row 1 is masked, and forbids the draft
    assert torch.equal(logits[2:], torch.zeros(2, VOCAB))  # rows after it are left alone
    state.accept(tokens[3:6])  # the state still follows the emitted tokens


def test_masks_apply_to_bf16_logits_like_fp32(grammars: Grammars) -> None:
    state = grammars.state(JsonFormat())
    fp32 = torch.randn(1, VOCAB)
    bf16 = fp32.to(torch.bfloat16)
    state.mask_rows(fp32)
    state.mask_rows(bf16)
    assert torch.equal(torch.isinf(bf16), torch.isinf(fp32))


@pytest.mark.parametrize(
    ("schema", "said"),
    [
        ('{"type": "nonsense"}', "json_schema: "),
        ("not json", "json_schema: not valid JSON"),
        ("[1, 2]", "json_schema: a JSON Schema is an object"),
    ],
)
def test_bad_schemas_are_named(grammars: Grammars, schema: str, said: str) -> None:
    with pytest.raises(GrammarError, match=said):
        grammars.state(JsonFormat(schema))


# (schema, an answer that breaks it, the keyword the refusal names): xgrammar's grammar for
# each schema lets that answer through, so these are refused before any token is masked.
UNENFORCED = [
    (
        {
            "type": "array",
            "items": {"type": "integer", "enum": [1, 2, 3]},
            "uniqueItems": True,
            "minItems": 3,
            "maxItems": 3,
        },
        [1, 1, 1],
        "uniqueItems",
    ),
    ({"type": "integer", "multipleOf": 7, "maximum": 100}, 11, "multipleOf"),
    ({"type": "number", "multipleOf": 0.5}, 0.3, "multipleOf"),
    ({"type": "object", "properties": {}, "required": ["zz"]}, {}, "required"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, 1, "oneOf"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, 1, "allOf"),
    ({"not": {}}, 1, "not"),
    ({"if": {"type": "integer"}, "then": {"minimum": 5}}, 1, "if"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, [1], "contains"),
    ({"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x", "minimum": 3}, 1, "minimum"),
    ({"type": "string", "enum": ["a", 1]}, 1, "type"),
    ({"type": "string", "pattern": "^a*$", "minLength": 2}, "a", "minLength"),
    ({"type": "string", "format": "email", "pattern": "^z"}, "a@b.com", "pattern"),
    ({"minimum": 3}, 1, "minimum"),
    (
        {
            "type": "object",
            "properties": {
                "a": {
                    "type": "array",
                    "items": {"enum": [1, 2]},
                    "minItems": 2,
                    "maxItems": 2,
                    "uniqueItems": True,
                }
            },
        },
        {"a": [1, 1]},
        "uniqueItems` at #/properties/a",
    ),
]


@pytest.mark.parametrize(("schema", "answer", "keyword"), UNENFORCED)
def test_keywords_the_grammar_cannot_hold_are_refused(
    schema: dict[str, object], answer: object, keyword: str
) -> None:
    """A json_schema request promises an answer that validates; where the grammar engine
    would let a breaking answer through, the format is a 400 naming the keyword instead."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    text = json.dumps(schema)
    assert not jsonschema.Draft202012Validator(schema).is_valid(answer)
    loose = xgrammar.Grammar.from_json_schema(text, any_whitespace=False)
    assert _is_grammar_accept_string(loose, json.dumps(answer))  # compact: ", " and ": "
    with pytest.raises(GrammarError, match=f"json_schema: .*`{re.escape(keyword)}"):
        JsonFormat(text)


@pytest.mark.parametrize(
    "schema",
    [
        *SCHEMAS,
        {"enum": ["red", "green"], "title": "Colour", "type": "string"},  # a pydantic Enum
        {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "Note"},
        {
            "$defs": {"Item": {"type": "object", "properties": {"n": {"type": "integer"}}}},
            "type": "object",
            "properties": {"item": {"$ref": "#/$defs/Item", "description": "one item"}},
            "required": ["item"],
        },
        {"type": "string", "minLength": 2, "maxLength": 8},
        {"type": "integer", "multipleOf": 5},
        {"type": "string", "format": "date", "description": "ISO date"},
        {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
    ],
)
def test_schemas_the_grammar_holds_are_accepted(
    grammars: Grammars, schema: dict[str, object]
) -> None:
    grammars.state(JsonFormat(json.dumps(schema)))  # compiles: no GrammarError


@pytest.mark.parametrize(
    ("schema", "said"),
    [
        # 3,000 levels once raised RecursionError out of json.loads (gRPC UNKNOWN); depth
        # also drives compile time, which a grammar's first use pays
        ('{"type":"array","items":' * 3000 + "{}" + "}" * 3000, "at most 65536 characters"),
        ('{"type":"array","items":' * 40 + "{}" + "}" * 40, "nested at most 32"),
        ('{"type":"object","properties":{"a":' * 20 + "{}" + "}}" * 20, "nested at most 32"),
        ('{"anyOf": []}', "`anyOf` at # is empty"),  # once: 0 tokens, "" is not JSON
        ('{"type": "integer", "minimum": 1e400}', "`minimum` at # must be a finite number"),
    ],
)
def test_schemas_too_deep_large_or_unsatisfiable_are_refused(schema: str, said: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(said)):
        JsonFormat(schema)


def test_nesting_counts_brackets_outside_strings_only() -> None:
    from rose.grammar import _nesting

    text = '{"a": "[[[{{{\\"]]]", "b": [[1]]}'  # brackets and an escaped quote in a string
    assert json.loads(text)["a"] == '[[[{{{"]]]'
    assert _nesting(text) == 3
    JsonFormat('{"type": "string", "description": "' + "[" * 100 + '"}')  # accepted


def test_a_discriminated_union_may_use_one_of() -> None:
    """pydantic writes a tagged union as ``oneOf`` + ``discriminator``: its alternatives
    require distinct constants, so no answer matches two and the grammar's anyOf reading
    of it is exact; the same union with a shared tag is refused."""
    from typing import Annotated, Literal

    import pydantic

    class Cat(pydantic.BaseModel):
        kind: Literal["cat"]
        lives: int

    class Dog(pydantic.BaseModel):
        kind: Literal["dog"]
        bark: str

    class Owner(pydantic.BaseModel):
        pet: Annotated[Cat | Dog, pydantic.Field(discriminator="kind")]

    schema = Owner.model_json_schema()
    assert "oneOf" in schema["properties"]["pet"]
    JsonFormat(json.dumps(schema))  # accepted
    schema["$defs"]["Dog"]["properties"]["kind"]["const"] = "cat"
    with pytest.raises(GrammarError, match="`oneOf` at #/properties/pet"):
        JsonFormat(json.dumps(schema))


def test_drafts_are_masked_before_the_target_verifies_them(
    grammars: Grammars,
    tokenizer,  # noqa: ANN001
) -> None:
    """Speculation under a grammar: a proposal is cut before its first draft the grammar
    forbids, so the target never verifies a draft it could not accept; the output is the
    one without speculation."""
    from rose.assets import ensure_model
    from rose.generate import GenerationConfig, GenerationEngine
    from rose.models.llama import LlamaForCausalLM
    from rose.sampling import SamplingParams
    from rose.spec import SpecConfig
    from rose.spec.proposer import Proposal, Verified, register_proposer

    model = LlamaForCausalLM.from_pretrained(Path(ensure_model(MODEL)))
    fmt = JsonFormat(json.dumps(SCHEMAS[0]))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a book about search engines as JSON."}],
        add_generation_prompt=True,
    )
    prompt = list(prompt if isinstance(prompt, list) else prompt["input_ids"])
    params = SamplingParams(max_tokens=24, response_format=fmt)
    plain = GenerationEngine(model, eos_ids=[EOS], grammars=grammars)
    [want] = plain.generate([prompt], params)
    # A raw newline: compact JSON has none between tokens, and a string may not hold one.
    [forbidden] = tokenizer("\n", add_special_tokens=False)["input_ids"]
    verified: list[Verified] = []

    class Probe:  # drafts the right continuation with a forbidden token in third place
        kv_copies = 0
        target_features = False

        def propose(self, todo):  # noqa: ANN001, ANN202
            out = []
            for r, k in todo:
                right = want.output_ids[len(r.output_ids) : len(r.output_ids) + k]
                out.append(Proposal((right[:2] + [forbidden] + right[3:])[:k]) if right else None)
            return out

        def accept(self, request, v: Verified) -> None:  # noqa: ANN001
            verified.append(v)

    register_proposer("grammar-probe", lambda _: Probe())
    spec = SpecConfig(method="grammar-probe", num_draft_tokens=4)
    engine = GenerationEngine(model, GenerationConfig(spec=spec), eos_ids=[EOS], grammars=grammars)
    [got] = engine.generate([prompt], params)
    assert got.output_ids == want.output_ids
    assert max(v.drafts for v in verified) == 2  # cut before the forbidden third draft
    assert engine.stats.accepted > 0
