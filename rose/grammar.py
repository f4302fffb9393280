"""Structured output: token masks that keep a generation inside a JSON grammar.

A request with a response format (`JsonFormat`: any JSON object, or one JSON Schema) gets a
`GrammarState`. Before a token is chosen at a position, the state sets the logits of every
token the grammar forbids there to -inf; once chosen, the token advances the state. Masking
happens on the logits, before `rose.sampling.token_probs`, so greedy argmax, sampling and
the speculative acceptance rules all see the constrained distribution, and speculation stays
exact with respect to it.

Speculation: a verification pass has logits for the positions after 0, 1, ..., k draft
tokens. `GrammarState.mask_rows` masks each row with the state the grammar would be in after
the drafts before it, by advancing through the drafts and rolling back; a draft the grammar
forbids ends the valid rows (the target's masked distribution gives that draft probability
0, so it is never accepted, and nothing after it is either).

Engine: xgrammar (PyPI), chosen by measurement (`python -m bench grammar`,
bench/results/grammar.md): on SmolLM2's 49,152-token vocabulary its mask + advance costs
4-9 us per token at the median and under 40 us at p99, llguidance's 15-20 us and 130-330 us.
Invariant: a state's position is the request's emitted tokens; only
`accept` moves it, and `mask_rows` returns it where it found it.
"""

from __future__ import annotations

import functools
import json
import math
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "MAX_SCHEMA_CHARS",
    "MAX_SCHEMA_DEPTH",
    "GrammarError",
    "GrammarState",
    "Grammars",
    "JsonFormat",
]


class GrammarError(ValueError):
    """A response format that cannot be compiled (the message says why)."""


@dataclass(frozen=True)
class JsonFormat:
    """OpenAI's ``response_format``: ``json_object`` (``schema`` None: any JSON object) or
    ``json_schema`` (``schema``: the schema as JSON text)."""

    schema: str | None = None

    def __post_init__(self) -> None:
        if self.schema is not None:
            if len(self.schema) > MAX_SCHEMA_CHARS:
                raise GrammarError(
                    f"json_schema: at most {MAX_SCHEMA_CHARS} characters, got {len(self.schema)}"
                )
            # nesting is bounded before anything recursive reads the text (json.loads,
            # the checks below, the compiler): a deep schema is refused, never a crash
            depth = _nesting(self.schema)
            if depth > MAX_SCHEMA_DEPTH:
                raise GrammarError(
                    f"json_schema: nested at most {MAX_SCHEMA_DEPTH} objects and arrays deep, "
                    f"got {depth}"
                )
            try:
                parsed = json.loads(self.schema)
            except ValueError as exc:
                raise GrammarError(f"json_schema: not valid JSON ({exc})") from None
            if not isinstance(parsed, dict):
                raise GrammarError("json_schema: a JSON Schema is an object")
            reason = _unenforced(parsed, "#")
            if reason is not None:
                why = (
                    ": the grammar engine cannot hold an answer to it (an answer could break "
                    "the schema)"
                    if "not supported" in reason
                    else ""
                )
                raise GrammarError(f"json_schema: {reason}{why}")


# Bounds on a json_schema's text: compile time grows with both (on this CPU, xgrammar took
# 0.06 s for arrays nested 64 deep and 0.3 s at 128; 0.65 s for 1,000 properties (49 kB) and
# 17 s for 3,000 (149 kB)), and compiles run beside the engine.
MAX_SCHEMA_CHARS = 65536
MAX_SCHEMA_DEPTH = 32


def _nesting(text: str) -> int:
    """How deep objects and arrays nest in JSON ``text`` (brackets inside strings skipped);
    linear and without recursion, so it is safe on any input."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


# Keywords that assert nothing (jsonschema ignores them when validating), or hold subschemas
# checked on their own.
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "$schema", "$id", "$anchor"}
    | {"deprecated", "readOnly", "writeOnly", "contentEncoding", "contentMediaType"}
    | {"$defs", "definitions", "discriminator"}
)
# Keywords xgrammar 0.2 ignores or treats loosely (oneOf as anyOf), measured by compiling a
# schema with each and matching an answer that breaks only that keyword.
_NEVER = (
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "contains",
    "minContains",
    "maxContains",
    "additionalItems",
    "$dynamicRef",
    "$recursiveRef",
)
# Keywords that stand alone in a schema (xgrammar ignores what stands beside them).
_ALONE = ("$ref", "anyOf", "oneOf", "allOf", "enum", "const")
_NUMERIC = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_STRING = ("minLength", "maxLength", "pattern")
_JSON_TYPES = {
    "string": (str,),
    "boolean": (bool,),
    "null": (type(None),),
    "object": (dict,),
    "array": (list,),
}


def _of_type(value: object, name: object) -> bool:
    if name in ("integer", "number"):
        return (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and (name == "number" or float(value).is_integer())
        )
    return isinstance(value, _JSON_TYPES.get(str(name), ()))


def _resolve(node: object, root: dict) -> object:
    """``node`` with its local ``$ref`` chain (``#/$defs/...``) followed in ``root``."""
    for _ in range(16):
        ref = node.get("$ref") if isinstance(node, dict) else None
        if not (isinstance(ref, str) and ref.startswith("#/")):
            break
        node = root
        for part in ref[2:].split("/"):
            key = part.replace("~1", "/").replace("~0", "~")
            node = node.get(key) if isinstance(node, dict) else None
    return node


def _tagged_union(node: dict, root: dict) -> bool:
    """Whether ``node``'s ``oneOf`` is a discriminated union (pydantic's shape): each
    alternative an object that requires the ``discriminator.propertyName`` property with
    constant values no other alternative has, so no answer can match two of them and the
    grammar's reading of oneOf as anyOf is exact."""
    tag = node.get("discriminator")
    tag = tag.get("propertyName") if isinstance(tag, dict) else None
    alternatives = node.get("oneOf")
    if not isinstance(tag, str) or not isinstance(alternatives, list):
        return False
    seen: set[str] = set()
    for alternative in alternatives:
        alternative = _resolve(alternative, root)
        if not isinstance(alternative, dict) or tag not in alternative.get("required", ()):
            return False
        props = alternative.get("properties")
        prop = _resolve(props.get(tag) if isinstance(props, dict) else None, root)
        if not isinstance(prop, dict):
            return False
        values = [prop["const"]] if "const" in prop else prop.get("enum")
        if not isinstance(values, list) or not values:
            return False
        keys = {json.dumps(v, sort_keys=True) for v in values}
        if keys & seen:
            return False
        seen |= keys
    return True


def _unenforced(node: object, at: str, root: dict | None = None) -> str | None:
    """The first keyword of JSON Schema ``node`` (at JSON pointer ``at`` of ``root``, the
    whole schema) that the grammar would not enforce, described; None when every keyword is
    held. Malformed schemas pass here and are refused by the compiler."""
    if not isinstance(node, dict):
        return None
    root = node if root is None else root
    for key in _NEVER:
        if key in node:
            return f"`{key}` at {at} is not supported"
    for key in ("anyOf", "oneOf", "enum"):
        if node.get(key) == []:
            return f"`{key}` at {at} is empty: no answer can match it"
    for key in _NUMERIC + ("minLength", "maxLength", "minItems", "maxItems"):
        value = node.get(key)
        if isinstance(value, float) and not math.isfinite(value):
            return f"`{key}` at {at} must be a finite number, got {value}"
    if "oneOf" in node and not _tagged_union(node, root):
        return (
            f"`oneOf` at {at} is not supported unless it is a discriminated union (use anyOf "
            "with alternatives that exclude each other)"
        )
    if node.get("uniqueItems") is True:
        return f"`uniqueItems` at {at} is not supported"
    asserting = set(node) - _ANNOTATIONS - {"format"}
    for key in _ALONE:
        if key not in node:
            continue
        beside = asserting - {key}
        values = node[key] if key == "enum" else [node[key]]
        if key in ("enum", "const") and beside == {"type"} and isinstance(values, list):
            if all(_of_type(v, node["type"]) for v in values):
                beside = set()  # the type says nothing the values do not
        if beside:
            return f"`{sorted(beside)[0]}` beside `{key}` at {at} is not supported"
    if "allOf" in node and isinstance(node["allOf"], list) and len(node["allOf"]) != 1:
        return f"`allOf` of {len(node['allOf'])} schemas at {at} is not supported (only 1)"
    kind = node.get("type")
    numeric = [k for k in _NUMERIC if k in node]
    string = [k for k in _STRING if k in node]
    if (numeric or string) and not isinstance(kind, str):
        return f"`{(numeric + string)[0]}` at {at} is supported under one `type` only"
    if kind == "number" and "multipleOf" in node:
        return f"`multipleOf` on a number at {at} is not supported (integers only)"
    if kind == "integer" and "multipleOf" in node and len(numeric) > 1:
        return f"`multipleOf` beside `{numeric[0]}` at {at} is not supported"
    if kind == "string" and len(string) + ("format" in node) > 1:
        if "format" in node:
            return f"`{string[0]}` beside `format` at {at} is not supported"
        if "pattern" in node:
            return f"`{[k for k in string if k != 'pattern'][0]}` beside `pattern` at {at} is not supported"
    props = node.get("properties")
    required = node.get("required")
    if isinstance(required, list):
        named = props if isinstance(props, dict) else {}
        missing = [r for r in required if r not in named]
        if missing:
            return (
                f"`required` property {missing[0]!r} at {at} is not in `properties`, "
                "which is not supported"
            )
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        children = node.get(key)
        if isinstance(children, dict):
            for name, child in children.items():
                found = _unenforced(child, f"{at}/{key}/{name}", root)
                if found:
                    return found
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        children = node.get(key)
        if isinstance(children, list):
            for i, child in enumerate(children):
                found = _unenforced(child, f"{at}/{key}/{i}", root)
                if found:
                    return found
    names = node.get("propertyNames")
    if isinstance(names, dict):  # it describes the keys: strings
        found = _unenforced({"type": "string", **names}, f"{at}/propertyNames", root)
        if found:
            return found
    for key in ("items", "additionalProperties", "unevaluatedItems"):
        found = _unenforced(node.get(key), f"{at}/{key}", root)
        if found:
            return found
    return None


class Grammars:
    """Compiles response formats for one model's tokenizer; one per served generator.

    tokenizer_dir: the model directory (its Hugging Face tokenizer files). vocab_size: the
    width of the model's logits (may exceed the tokenizer's). stop_ids: the tokens that end a
    generation (EOS); a finished grammar allows only these.
    """

    def __init__(self, tokenizer_dir: str | Path, vocab_size: int, stop_ids: Sequence[int]):
        self.tokenizer_dir = Path(tokenizer_dir)
        self.vocab_size = vocab_size
        self.stop_ids = list(stop_ids)
        self._compiler = None  # built by the first request with a format (~0.5 s)
        self._lock = threading.Lock()  # compiles may come from several threads

    def _compiler_now(self):  # type: ignore[no-untyped-def]
        if self._compiler is None:
            import xgrammar
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(self.tokenizer_dir))
            info = xgrammar.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids
            )
            self._compiler = xgrammar.GrammarCompiler(info)  # caches compiled grammars
        return self._compiler

    def state(self, fmt: JsonFormat) -> GrammarState:
        """A fresh state at the start of a generation in ``fmt``; raises `GrammarError`."""
        import xgrammar

        with self._lock:  # only the compiler's creation: xgrammar compiles from any thread
            compiler = self._compiler_now()
        try:
            # json_object is the schema of any object (xgrammar's built-in JSON grammar
            # would also allow arrays and scalars). Compact JSON, no free whitespace: a
            # model cannot pad its answer with endless blanks. Compiled grammars are cached
            # by their schema, so `state` in a worker thread first (Tulip does) leaves the
            # engine thread a cache hit.
            compiled = compiler.compile_json_schema(
                fmt.schema or '{"type": "object"}', any_whitespace=False
            )
        except (RuntimeError, ValueError, TypeError) as exc:  # e.g. an unsupported keyword
            # xgrammar's C++ errors start with "[time] file.cc:line: "
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            reason = re.sub(r"^(\[[^\]]*\]\s*)?(\S+\.(cc|h|cpp):\d+:\s*)?", "", first)
            raise GrammarError(f"json_schema: {reason}") from None
        return GrammarState(xgrammar, compiled, self.vocab_size)


class GrammarState:
    """Where one generation stands in its grammar (see the module docstring)."""

    def __init__(self, xgr, compiled, vocab_size: int) -> None:  # type: ignore[no-untyped-def]
        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32

    @property
    def finished(self) -> bool:
        """True once the grammar accepted a stop token."""
        return bool(self._matcher.is_terminated())

    def mask_rows(self, logits: torch.Tensor, drafts: Sequence[int] = ()) -> int:
        """Mask ``logits [k + 1, V]`` in place: row ``i`` for the position after ``drafts[:i]``.

        Returns how many drafts the grammar allows in a row (rows after the first forbidden
        draft are left as they are: nothing there can be accepted). The state is unchanged."""
        advanced = 0
        for i in range(logits.shape[0]):
            self._matcher.fill_next_token_bitmask(self._bitmask)
            self._apply(logits[i : i + 1])
            if i == len(drafts) or not self._matcher.accept_token(int(drafts[i])):
                break
            advanced += 1
        if advanced:
            self._matcher.rollback(advanced)
        return advanced

    def allowed_drafts(self, drafts: Sequence[int]) -> int:
        """How many of ``drafts``, in a row from the start, the grammar allows here (the
        state is unchanged): a proposal is cut there before the target verifies it."""
        advanced = 0
        for token in drafts:
            if not self._matcher.accept_token(int(token)):
                break
            advanced += 1
        if advanced:
            self._matcher.rollback(advanced)
        return advanced

    def _apply(self, row: torch.Tensor) -> None:
        """-inf where the bitmask has a 0 bit, in ``row [1, V]``."""
        if row.device.type == "cpu" and row.dtype == torch.float32 and row.is_contiguous():
            self._xgr.apply_token_bitmask_inplace(row, self._bitmask)  # its CPU kernel
            return
        bits = self._bitmask.to(row.device, non_blocking=True)  # [1, W] int32
        shifts = _shifts(row.device)
        allowed = ((bits[..., None] >> shifts) & 1).flatten(1)[:, : row.shape[-1]]  # [1, V]
        row.masked_fill_(allowed == 0, float("-inf"))

    def accept(self, tokens: Sequence[int]) -> None:
        """Advance past tokens the generation emitted (each was allowed by its mask)."""
        for token in tokens:
            if not self._matcher.accept_token(int(token)):
                raise RuntimeError(f"token {token} was emitted against its grammar mask")


@functools.cache
def _shifts(device: torch.device) -> torch.Tensor:
    """``[32]`` int32 bit positions on ``device``, made once per device."""
    return torch.arange(32, device=device, dtype=torch.int32)
