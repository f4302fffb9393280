"""The bad-input matrix: malformed, out-of-range and unauthorized requests on every route
answer a 4xx in OpenAI's error envelope, and the next good request still succeeds.

One Ivy process (API key on) serves both kinds of model, each from a real Tulip process
on the CPU: multilingual-e5-small for /v1/embeddings, the rerank routes and /tokenize,
smollm2-135m-instruct for /v1/chat/completions and /v1/completions. Requests go out over
a plain socket, so the bytes on the wire are exactly the case's (broken JSON, non-UTF-8
bodies and headers, a Content-Length over the cap, chunked bodies); the good request
after each case goes through httpx.

Every case states its exact status. Validation failures are 400, as in OpenAI's API
(never FastAPI's 422); a missing or wrong key 401; an unknown model or path 404; a wrong
method 405; a body over the cap 413. Ivy reads every body as JSON whatever its
Content-Type (``curl -d`` labels JSON bodies application/x-www-form-urlencoded), so a
form, multipart or gzip body is a 400 (invalid JSON), not a 415.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tulip.process import TulipProcess, free_port

E5 = "multilingual-e5-small"
SMOL = "smollm2-135m-instruct"
KEY = "bad-inputs-key"
MAX_BODY = 1024 * 1024  # Ivy's body cap in this module (--max-body-bytes)
E5_CONTEXT = 512  # multilingual-e5-small's longest input, special tokens included
E5_VOCAB = 250_037  # rows of its embedding table (the tokenizer has 250,002 pieces)
SMOL_CONTEXT = 8192
SMOL_VOCAB = 49_152

EMBED = "/v1/embeddings"
RERANK_PATHS = ("/v1/rerank", "/v2/rerank", "/rerank")
TOKENIZE = "/tokenize"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MODELS = "/v1/models"
POST_ROUTES = (EMBED, *RERANK_PATHS, TOKENIZE, CHAT, COMPLETIONS)

MESSAGES = [{"role": "user", "content": "Hi"}]
GOOD: dict[str, dict[str, Any]] = {
    EMBED: {"model": E5, "input": "how do plants grow?"},
    "/v1/rerank": {"model": E5, "query": "plants", "documents": ["Plants grow.", "Paris."]},
    "/v2/rerank": {"model": E5, "query": "plants", "documents": [{"text": "Plants grow."}]},
    "/rerank": {"model": E5, "query": "plants", "documents": ["Plants grow."], "top_n": 1},
    TOKENIZE: {"model": E5, "input": "hello"},
    CHAT: {"model": SMOL, "messages": MESSAGES, "max_tokens": 1, "temperature": 0},
    COMPLETIONS: {"model": SMOL, "prompt": "The sky is", "max_tokens": 1, "temperature": 0},
}

AUTH = (b"authorization", f"Bearer {KEY}".encode())
JSON_TYPE = (b"content-type", b"application/json")
# Error bodies must not leak server internals.
LEAK = re.compile(r"Traceback|File \"|\.py\b|site-packages|/work/|/home/|/usr/")


# ---- the cases -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One bad request and the answer it must get."""

    id: str
    method: str
    path: str
    status: int
    body: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = (AUTH, JSON_TYPE)
    param: str | None = None  # the error's `param`, when the case is about one field
    code: str | None = None  # the error's `code`, when it has one worth checking
    chunked: bool = False  # send the body with Transfer-Encoding: chunked
    declared_length: int | None = None  # a Content-Length header without that many bytes
    good: str = EMBED  # the route whose good request must succeed right after


def dumps(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def with_(path: str, **fields: Any) -> bytes:
    """The route's good body with some fields replaced."""
    return dumps({**GOOD[path], **fields})


def without(path: str, name: str) -> bytes:
    return dumps({k: v for k, v in GOOD[path].items() if k != name})


def short(path: str) -> str:
    return path.strip("/").replace("/", "-") or "root"


def post(
    case_id: str, path: str, body: bytes, status: int = 400, param: str | None = None, **kw: Any
) -> Case:
    good = path if path in GOOD else EMBED
    return Case(
        f"{short(path)}:{case_id}", "POST", path, status, body, param=param, good=good, **kw
    )


def auth_case(path: str, name: str, headers: tuple[tuple[bytes, bytes], ...]) -> Case:
    """The route's good body sent with these headers instead of the right key."""
    return Case(
        f"{short(path)}:{name}",
        "POST",
        path,
        401,
        with_(path),
        headers=headers,
        code="invalid_api_key",
        good=path,
    )


def every_post_route() -> list[Case]:
    """What every POST route must refuse the same way (a few variants on two of them)."""
    cases = []
    nested = b"[" * 100_000 + b"]" * 100_000
    for path in POST_ROUTES:
        good_body = with_(path)
        cases += [
            post("empty-body", path, b""),
            post("truncated-json", path, good_body[:-5]),
            post("json-array", path, b"[]"),
            post("json-null", path, b"null"),
            post("json-string", path, b'"hello"'),
            post("empty-object", path, b"{}"),
            post("nan-literal", path, good_body[:-1] + b', "x": NaN}'),
            post("non-utf8-body", path, good_body[:-1] + b', "user": "\xff\xfe"}'),
            post("nested-100k", path, nested),
            post("model-not-string", path, with_(path, model=7), param="model"),
            post("model-missing", path, without(path, "model"), param="model"),
            post("unknown-model", path, with_(path, model="no-such-model"), 404, "model"),
            auth_case(path, "no-api-key", (JSON_TYPE,)),
            auth_case(path, "wrong-api-key", ((b"authorization", b"Bearer nope"), JSON_TYPE)),
            auth_case(
                path, "non-utf8-api-key", ((b"authorization", b"Bearer \xff\xfe"), JSON_TYPE)
            ),
            post(
                "form-encoded",
                path,
                b"model=x&input=hello",
                headers=(AUTH, (b"content-type", b"application/x-www-form-urlencoded")),
            ),
            post("declared-over-cap", path, b"", 413, declared_length=MAX_BODY + 1),
            Case(f"{short(path)}:get", "GET", path, 405, good=path),
        ]
        if path in (EMBED, CHAT):
            cases += [
                post("json-number", path, b"42"),
                post("infinity-literal", path, good_body[:-1] + b', "x": -Infinity}'),
                post("model-null", path, with_(path, model=None), param="model"),
                auth_case(path, "basic-auth", ((b"authorization", b"Basic dXNlcjpwYXNz"),)),
                auth_case(path, "bearer-without-key", ((b"authorization", b"Bearer "),)),
                post(
                    "latin1-charset",
                    path,
                    good_body[:-1] + ', "user": "caf\xe9"}'.encode("latin-1"),
                    headers=(AUTH, (b"content-type", b"application/json; charset=latin-1")),
                ),
                post(
                    "multipart",
                    path,
                    b'--b\r\ncontent-disposition: form-data; name="model"\r\n\r\nx\r\n--b--\r\n',
                    headers=(AUTH, (b"content-type", b"multipart/form-data; boundary=b")),
                ),
            ]
    return cases


def embeddings() -> list[Case]:
    p = EMBED
    return [
        post("input-empty-string", p, with_(p, input=""), param="input"),
        post("input-empty-list", p, with_(p, input=[]), param="input"),
        post("input-list-of-empty", p, with_(p, input=["a", ""]), param="input"),
        post("input-2049-strings", p, with_(p, input=["a"] * 2049), param="input"),
        post("input-float", p, with_(p, input=12.5), param="input"),
        post("input-bool", p, with_(p, input=True), param="input"),
        post("input-object", p, with_(p, input={"text": "a"}), param="input"),
        post("input-mixed", p, with_(p, input=[1, "a"]), param="input"),
        post("input-null", p, with_(p, input=None), param="input"),
        post("input-missing", p, without(p, "input"), param="input"),
        post("input-empty-id-row", p, with_(p, input=[[1, 2], []]), param="input"),
        post("token-id-negative", p, with_(p, input=[0, -1, 2]), param="input"),
        post("token-id-2^32", p, with_(p, input=[0, 2**32, 2]), param="input"),
        post("token-id-2^63", p, with_(p, input=[[0, 2**63, 2]]), param="input"),
        post("token-id-2^64", p, with_(p, input=[0, 2**64, 2]), param="input"),
        post("token-id-float", p, with_(p, input=[0, 1.5, 2]), param="input"),
        post("token-id-out-of-vocab", p, with_(p, input=[0, E5_VOCAB, 2]), param="input"),
        post("token-id-uint32-max", p, with_(p, input=[0, 2**32 - 1, 2]), param="input"),
        post("token-ids-over-context", p, with_(p, input=[5] * (E5_CONTEXT + 1)), param="input"),
        post(
            "huge-string-within-cap",
            p,
            with_(p, input="word " * ((MAX_BODY - 1024) // 5)),
            param="input",
            code="context_length_exceeded",
        ),
        post("dimensions-0", p, with_(p, dimensions=0), param="dimensions"),
        post("dimensions-negative", p, with_(p, dimensions=-1), param="dimensions"),
        post("dimensions-over-model", p, with_(p, dimensions=385), param="dimensions"),
        post("dimensions-2^32", p, with_(p, dimensions=2**32), param="dimensions"),
        post("dimensions-2^63", p, with_(p, dimensions=2**63), param="dimensions"),
        post("dimensions-2^64", p, with_(p, dimensions=2**64), param="dimensions"),
        post("dimensions-string", p, with_(p, dimensions="64"), param="dimensions"),
        post("dimensions-float", p, with_(p, dimensions=64.5), param="dimensions"),
        post("dimensions-1e400", p, with_(p)[:-1] + b', "dimensions": 1e400}'),
        post("encoding-format", p, with_(p, encoding_format="int8"), param="encoding_format"),
        post("input-type", p, with_(p, input_type="question"), param="input_type"),
        post("truncate-string", p, with_(p, truncate="yes"), param="truncate"),
        post("user-number", p, with_(p, user=5), param="user"),
        post("lone-surrogate", p, b'{"model": "%s", "input": "\\ud800"}' % E5.encode()),
        post("control-char", p, b'{"model": "%s", "input": "a\x01b"}' % E5.encode()),
        post(
            "duplicate-key-bad-last",
            p,
            b'{"model": "%s", "input": "a", "input": 5}' % E5.encode(),
            param="input",
        ),
        post(
            "nested-input-500",
            p,
            b'{"model": "%s", "input": %s}' % (E5.encode(), b"[" * 500 + b"1" + b"]" * 500),
            param="input",
        ),
        post("generator-model", p, with_(p, model=SMOL), param="model"),
        post(
            "gzip-without-decoding",
            p,
            gzip.compress(with_(p)),
            headers=(AUTH, JSON_TYPE, (b"content-encoding", b"gzip")),
        ),
        Case(
            "embeddings:chunked-over-cap",
            "POST",
            p,
            413,
            with_(p, input="x" * MAX_BODY),
            chunked=True,
        ),
    ]


def rerank() -> list[Case]:
    v1, v2, jina = RERANK_PATHS
    return [
        post("query-empty", v1, with_(v1, query=""), param="query"),
        post("query-missing", v2, without(v2, "query"), param="query"),
        post("query-number", jina, with_(jina, query=5), param="query"),
        post("query-over-context", v1, with_(v1, query="word " * 2000), param="query"),
        post("documents-empty", v1, with_(v1, documents=[]), param="documents"),
        post("documents-missing", v2, without(v2, "documents"), param="documents"),
        post("documents-string", jina, with_(jina, documents="a"), param="documents"),
        post("documents-2049", v1, with_(v1, documents=["a"] * 2049), param="documents"),
        post("document-number", v2, with_(v2, documents=["a", 5]), param="documents"),
        post("document-object-no-text", v2, with_(v2, documents=[{}]), param="documents"),
        post("document-text-number", v2, with_(v2, documents=[{"text": 5}]), param="documents"),
        post("top-n-0", v1, with_(v1, top_n=0), param="top_n"),
        post("top-n-negative", v2, with_(v2, top_n=-1), param="top_n"),
        post("top-n-2^32", jina, with_(jina, top_n=2**32), param="top_n"),
        post("top-n-2^63", v1, with_(v1, top_n=2**63), param="top_n"),
        post("top-n-2^64", v2, with_(v2, top_n=2**64), param="top_n"),
        post("top-n-string", jina, with_(jina, top_n="2"), param="top_n"),
        post("top-n-float", v1, with_(v1, top_n=1.5), param="top_n"),
        post(
            "max-tokens-per-doc-0", v1, with_(v1, max_tokens_per_doc=0), param="max_tokens_per_doc"
        ),
        post(
            "max-tokens-per-doc-2^32",
            v2,
            with_(v2, max_tokens_per_doc=2**32),
            param="max_tokens_per_doc",
        ),
        post(
            "max-tokens-per-doc-negative",
            jina,
            with_(jina, max_tokens_per_doc=-5),
            param="max_tokens_per_doc",
        ),
        post(
            "return-documents-string",
            v1,
            with_(v1, return_documents="yes"),
            param="return_documents",
        ),
        post("generator-model", v2, with_(v2, model=SMOL), param="model"),
    ]


def tokenize() -> list[Case]:
    p = TOKENIZE
    return [
        post("input-empty-string", p, with_(p, input=""), param="input"),
        post("input-empty-list", p, with_(p, input=[]), param="input"),
        post("input-2049", p, with_(p, input=["a"] * 2049), param="input"),
        post("input-number", p, with_(p, input=5), param="input"),
        post("input-token-ids", p, with_(p, input=[[1, 2]]), param="input"),
        post("input-missing", p, without(p, "input"), param="input"),
        post(
            "add-special-tokens-string",
            p,
            with_(p, add_special_tokens="no"),
            param="add_special_tokens",
        ),
    ]


def chat() -> list[Case]:
    p = CHAT

    def msgs(*messages: Any) -> bytes:
        return with_(p, messages=list(messages))

    return [
        post("messages-empty", p, msgs(), param="messages"),
        post("messages-missing", p, without(p, "messages"), param="messages"),
        post("messages-string", p, with_(p, messages="Hi"), param="messages"),
        post("role-unknown", p, msgs({"role": "robot", "content": "x"}), param="messages"),
        post("role-missing", p, msgs({"content": "x"}), param="messages"),
        post("content-number", p, msgs({"role": "user", "content": 5}), param="messages"),
        post("content-missing", p, msgs({"role": "user"}), param="messages"),
        post("content-empty-parts", p, msgs({"role": "user", "content": []}), param="messages"),
        post(
            "content-image-part",
            p,
            msgs({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
            param="messages",
        ),
        post(
            "huge-content-within-cap",
            p,
            msgs({"role": "user", "content": "word " * ((MAX_BODY - 1024) // 5)}),
            param="messages",
            code="context_length_exceeded",
        ),
        post("max-tokens-0", p, with_(p, max_tokens=0), param="max_tokens"),
        post("max-tokens-negative", p, with_(p, max_tokens=-1), param="max_tokens"),
        post("max-tokens-2^32", p, with_(p, max_tokens=2**32), param="max_tokens"),
        post("max-tokens-2^63", p, with_(p, max_tokens=2**63), param="max_tokens"),
        post("max-tokens-float", p, with_(p, max_tokens=1.5), param="max_tokens"),
        post("max-tokens-string", p, with_(p, max_tokens="1"), param="max_tokens"),
        post(
            "max-tokens-over-context",
            p,
            with_(p, max_tokens=SMOL_CONTEXT),
            param="messages",
            code="context_length_exceeded",
        ),
        post(
            "max-completion-tokens-0",
            p,
            with_(p, max_completion_tokens=0),
            param="max_completion_tokens",
        ),
        post(
            "max-completion-tokens-2^32",
            p,
            with_(p, max_completion_tokens=2**32),
            param="max_completion_tokens",
        ),
        post("temperature-negative", p, with_(p, temperature=-0.1), param="temperature"),
        post("temperature-2.5", p, with_(p, temperature=2.5), param="temperature"),
        post("temperature-1e308", p, with_(p, temperature=1e308), param="temperature"),
        post("temperature-string", p, with_(p, temperature="hot"), param="temperature"),
        post("temperature-nan", p, with_(p)[:-1] + b', "temperature": NaN}'),
        post("top-p-negative", p, with_(p, top_p=-0.5), param="top_p"),
        post("top-p-1.5", p, with_(p, top_p=1.5), param="top_p"),
        post("top-k-negative", p, with_(p, top_k=-1), param="top_k"),
        post("top-k-2^32", p, with_(p, top_k=2**32), param="top_k"),
        post("top-k-2^63", p, with_(p, top_k=2**63), param="top_k"),
        post("top-k-2^64", p, with_(p, top_k=2**64), param="top_k"),
        post("top-k-float", p, with_(p, top_k=2.5), param="top_k"),
        post("seed-2^64", p, with_(p, seed=2**64), param="seed"),
        post("seed-below-int64", p, with_(p, seed=-(2**63) - 1), param="seed"),
        post("seed-float", p, with_(p, seed=1.5), param="seed"),
        post("stop-5-strings", p, with_(p, stop=["a", "b", "c", "d", "e"]), param="stop"),
        post("stop-empty-string", p, with_(p, stop=[""]), param="stop"),
        post("stop-too-long", p, with_(p, stop="x" * 1025), param="stop"),
        post("stop-number", p, with_(p, stop=5), param="stop"),
        post("n-129", p, with_(p, n=129), param="n"),
        post("n-0", p, with_(p, n=0), param="n"),
        post("n-2^64", p, with_(p, n=2**64), param="n"),
        post("stream-string", p, with_(p, stream="yes"), param="stream"),
        post(
            "stream-options-without-stream",
            p,
            with_(p, stream_options={"include_usage": True}),
            param="stream_options",
        ),
        post(
            "stream-options-number",
            p,
            with_(p, stream=True, stream_options=5),
            param="stream_options",
        ),
        post(
            "stream-options-usage-string",
            p,
            with_(p, stream=True, stream_options={"include_usage": "yes"}),
            param="stream_options",
        ),
        post("stream-max-tokens-0", p, with_(p, stream=True, max_tokens=0), param="max_tokens"),
        post("stream-top-k-2^32", p, with_(p, stream=True, top_k=2**32), param="top_k"),
        post("logprobs-number", p, with_(p, logprobs=1), param="logprobs"),
        # top_logprobs is the number of alternatives shown with logprobs: true (OpenAI's
        # rule), at most 20.
        post("top-logprobs-without-logprobs", p, with_(p, top_logprobs=3), param="top_logprobs"),
        post("top-logprobs-21", p, with_(p, logprobs=True, top_logprobs=21), param="top_logprobs"),
        post(
            "top-logprobs-negative",
            p,
            with_(p, logprobs=True, top_logprobs=-1),
            param="top_logprobs",
        ),
        # Fields that would change the answer are refused by name, never ignored: tools
        # for a model whose chat template takes none (SmolLM2's), tool_choice without tools.
        post(
            "tools",
            p,
            with_(p, tools=[{"type": "function", "function": {"name": "f"}}]),
            param="tools",
        ),
        post("tool-choice-required", p, with_(p, tool_choice="required"), param="tool_choice"),
        post("functions", p, with_(p, functions=[{"name": "f"}]), param="functions"),
        post("function-call", p, with_(p, function_call={"name": "f"}), param="function_call"),
        post(
            "response-format-unknown",
            p,
            with_(p, response_format={"type": "xml"}),
            param="response_format",
        ),
        post("presence-penalty-3", p, with_(p, presence_penalty=3), param="presence_penalty"),
        post("repetition-penalty-0", p, with_(p, repetition_penalty=0), param="repetition_penalty"),
        post("min-p-1.5", p, with_(p, min_p=1.5), param="min_p"),
        post("min-tokens-over-max", p, with_(p, min_tokens=9, max_tokens=8), param="min_tokens"),
        post(
            "stop-token-id-out-of-vocab",
            p,
            with_(p, stop_token_ids=[SMOL_VOCAB]),
            param="stop_token_ids",
        ),
        post("ignore-eos-string", p, with_(p, ignore_eos="yes"), param="ignore_eos"),
        post(
            "ignore-eos-with-json",
            p,
            with_(p, ignore_eos=True, response_format={"type": "json_object"}),
            param="ignore_eos",
        ),
        post(
            "min-tokens-with-json",
            p,
            with_(p, min_tokens=2, response_format={"type": "json_object"}),
            param="min_tokens",
        ),
        post(
            "frequency-penalty-under",
            p,
            with_(p, frequency_penalty=-2.01),
            param="frequency_penalty",
        ),
        post(
            "frequency-penalty-string",
            p,
            with_(p, frequency_penalty="1"),
            param="frequency_penalty",
        ),
        post("logit-bias-over", p, with_(p, logit_bias={"50": 100.5}), param="logit_bias"),
        post("logit-bias-word", p, with_(p, logit_bias={"the": 1}), param="logit_bias"),
        post("logit-bias-vocab", p, with_(p, logit_bias={"49152": 1}), param="logit_bias"),
        post("embedding-model", p, with_(p, model=E5), param="model"),
        Case("chat:put", "PUT", p, 405, with_(p), good=p),
    ]


def completions() -> list[Case]:
    p = COMPLETIONS
    return [
        post("prompt-missing", p, without(p, "prompt"), param="prompt"),
        post("prompt-number", p, with_(p, prompt=5), param="prompt"),
        post("prompt-empty-list", p, with_(p, prompt=[]), param="prompt"),
        post("prompt-empty-id-row", p, with_(p, prompt=[[]]), param="prompt"),
        post("prompt-empty-string", p, with_(p, prompt=""), param="prompt"),
        post("prompt-mixed-rows", p, with_(p, prompt=[[1, 2], ["a"]]), param="prompt"),
        post("prompt-2049", p, with_(p, prompt=["a"] * 2049), param="prompt"),
        post("token-id-negative", p, with_(p, prompt=[1, -1]), param="prompt"),
        post("token-id-2^32", p, with_(p, prompt=[1, 2**32]), param="prompt"),
        post("token-id-2^63", p, with_(p, prompt=[[1, 2**63]]), param="prompt"),
        post("token-id-out-of-vocab", p, with_(p, prompt=[1, SMOL_VOCAB]), param="prompt"),
        post(
            "token-ids-over-context",
            p,
            with_(p, prompt=[1] * SMOL_CONTEXT),
            param="prompt",
            code="context_length_exceeded",
        ),
        post("max-tokens-2^32", p, with_(p, max_tokens=2**32), param="max_tokens"),
        post("max-tokens-0", p, with_(p, max_tokens=0), param="max_tokens"),
        post("top-k-2^32", p, with_(p, top_k=2**32), param="top_k"),
        post("top-p-2", p, with_(p, top_p=2), param="top_p"),
        post("temperature-infinity", p, with_(p)[:-1] + b', "temperature": Infinity}'),
        post("seed-2^64", p, with_(p, seed=2**64), param="seed"),
        post("stop-list-too-long-string", p, with_(p, stop=["ok", "x" * 1025]), param="stop"),
        post("best-of-2", p, with_(p, best_of=2), param="best_of"),
        post("logprobs-6", p, with_(p, logprobs=6), param="logprobs"),  # OpenAI's limit: 5
        post("logprobs-negative", p, with_(p, logprobs=-1), param="logprobs"),
        post("logprobs-bool", p, with_(p, logprobs=True), param="logprobs"),
        post("suffix", p, with_(p, suffix="x"), param="suffix"),
        post("n-129", p, with_(p, n=129), param="n"),
        post("n-string", p, with_(p, n="2"), param="n"),
        post("presence-penalty-3", p, with_(p, presence_penalty=-3), param="presence_penalty"),
        post(
            "repetition-penalty-negative",
            p,
            with_(p, repetition_penalty=-1),
            param="repetition_penalty",
        ),
        post("min-tokens-over-default-max", p, with_(p, min_tokens=17), param="min_tokens"),
        post("stop-token-ids-negative", p, with_(p, stop_token_ids=[-1]), param="stop_token_ids"),
        post("logit-bias-negative-id", p, with_(p, logit_bias={"-1": 1}), param="logit_bias"),
        post(
            "stream-options-without-stream", p, with_(p, stream_options={}), param="stream_options"
        ),
        post("embedding-model", p, with_(p, model=E5), param="model"),
    ]


def other_routes() -> list[Case]:
    def req(case_id: str, method: str, path: str, status: int, **kw: Any) -> Case:
        return Case(case_id, method, path, status, **kw)

    return [
        req(
            "models:no-api-key", "GET", MODELS, 401, headers=(), code="invalid_api_key", good=MODELS
        ),
        req(
            "models:wrong-api-key",
            "GET",
            MODELS,
            401,
            headers=((b"authorization", b"Bearer nope"),),
            code="invalid_api_key",
            good=MODELS,
        ),
        req(
            "models:non-utf8-api-key",
            "GET",
            MODELS,
            401,
            headers=((b"authorization", b"Bearer \xff\xfe"),),
            code="invalid_api_key",
            good=MODELS,
        ),
        req("models:post", "POST", MODELS, 405, body=b"{}", good=MODELS),
        req("models:delete", "DELETE", MODELS, 405, good=MODELS),
        req("unknown:get-v1-nope", "GET", "/v1/nope", 404),
        req("unknown:post-v1-nope", "POST", "/v1/nope", 404, body=with_(EMBED)),
        req("unknown:get-root", "GET", "/", 404),
        req("unknown:post-root", "POST", "/", 404, body=with_(EMBED)),
        req("unknown:embeddings-suffix", "POST", EMBED + "/extra", 404, body=with_(EMBED)),
        req("unknown:embedding-typo", "POST", "/v1/embedding", 404, body=with_(EMBED)),
        req("unknown:percent-ff", "GET", "/v1/%FF%FE", 404),
        req("unknown:v3-rerank", "POST", "/v3/rerank", 404, body=with_("/v1/rerank")),
        req("method:put-embeddings", "PUT", EMBED, 405, body=with_(EMBED)),
        req("method:delete-rerank", "DELETE", "/v1/rerank", 405),
        req("method:patch-tokenize", "PATCH", TOKENIZE, 405, body=with_(TOKENIZE), good=TOKENIZE),
        req("method:options-embeddings", "OPTIONS", EMBED, 405),
        req("method:post-health-live", "POST", "/health/live", 405),
        req("method:get-completions", "GET", COMPLETIONS, 405, good=COMPLETIONS),
        # vLLM's /classify needs a classifier (a cross-encoder); this stack serves none
        post("embedder", "/classify", dumps({"model": E5, "input": "x"}), param="model"),
        post("no-input", "/classify", dumps({"model": E5}), param="input"),
        post("empty-input", "/classify", dumps({"input": []}), param="input"),
        post("chat-model", "/classify", dumps({"model": SMOL, "input": ["x"]}), param="model"),
    ]


CASES = every_post_route() + embeddings() + rerank() + tokenize() + chat() + completions()
CASES += other_routes()


# ---- the stack -----------------------------------------------------------------------------
@dataclass
class Stack:
    host: str
    port: int
    ivy: subprocess.Popen[bytes]
    client: httpx.Client
    tulips: list[TulipProcess] = field(default_factory=list)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from rose.assets import ensure_model

    e5_dir, smol_dir = Path(ensure_model(E5)), Path(ensure_model(SMOL))
    logs = tmp_path_factory.mktemp("bad-inputs")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    e5 = TulipProcess(
        ["--model", str(e5_dir), "--model-name", E5, "--device", "cpu", "--threads", "1"],
        log_path=logs / "e5.log",
        env=env,
    )
    smol = TulipProcess(
        ["--model", str(smol_dir), "--model-name", SMOL, "--device", "cpu", "--threads", "1"]
        + ["--kv-pages", "128", "--max-running-seqs", "4"],
        log_path=logs / "smol.log",
        env=env,
    )
    port = free_port()
    with e5, smol:
        ivy_log = (logs / "ivy.log").open("wb")
        ivy = subprocess.Popen(
            [sys.executable, "-m", "ivy", "--port", str(port), "--workers", "1"]
            + ["--model", f"{E5}={e5_dir}", "--model", f"{SMOL}={smol_dir}"]
            + ["--replicas", f"{E5}={e5.target}", "--replicas", f"{SMOL}={smol.target}"]
            + ["--max-body-bytes", str(MAX_BODY)],
            stdout=ivy_log,
            stderr=subprocess.STDOUT,
            env=dict(env, IVY_API_KEYS=KEY),
        )
        base = f"http://127.0.0.1:{port}"
        client = httpx.Client(base_url=base, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
        try:
            e5.wait_serving()
            smol.wait_serving()
            deadline = time.monotonic() + 120
            while True:
                assert ivy.poll() is None, (logs / "ivy.log").read_text()[-4000:]
                with contextlib.suppress(httpx.HTTPError):
                    if client.get("/health/ready", timeout=2).status_code == 200:
                        break
                assert time.monotonic() < deadline, "ivy not ready"
                time.sleep(0.2)
            yield Stack("127.0.0.1", port, ivy, client, [e5, smol])
        finally:
            client.close()
            ivy.terminate()
            try:
                ivy.wait(30)
            except subprocess.TimeoutExpired:
                ivy.kill()
                ivy.wait()
            ivy_log.close()


# ---- raw HTTP ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


def raw_request(stack: Stack, case: Case) -> Reply:
    """Send the case's exact bytes over a fresh connection and read the whole answer."""
    head = [f"{case.method} {case.path} HTTP/1.1".encode(), f"host: {stack.host}".encode()]
    head += [name + b": " + value for name, value in case.headers]
    if case.chunked:
        head.append(b"transfer-encoding: chunked")
    elif case.declared_length is not None:
        head.append(b"content-length: %d" % case.declared_length)
    else:
        head.append(b"content-length: %d" % len(case.body))
    head.append(b"connection: close")
    payload = b"\r\n".join(head) + b"\r\n\r\n"
    with socket.create_connection((stack.host, stack.port), timeout=60) as sock:
        try:
            if case.chunked:
                sock.sendall(payload)
                step = 64 * 1024
                for start in range(0, len(case.body), step):
                    piece = case.body[start : start + step]
                    sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                sock.sendall(b"0\r\n\r\n")
            elif case.declared_length is not None:
                sock.sendall(payload)  # the promised body never comes
            else:
                sock.sendall(payload + case.body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered early (e.g. 413) and stopped reading
        chunks = []
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                chunks.append(chunk)
    data = b"".join(chunks)
    assert data, f"{case.id}: no answer"
    top, _, body = data.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = _dechunk(body)
    return Reply(status, headers, body)


def _dechunk(data: bytes) -> bytes:
    out = []
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out.append(rest[:size])
        data = rest[size + 2 :]
    return b"".join(out)


def good_request(stack: Stack, route: str) -> httpx.Response:
    if route == MODELS:
        return stack.client.get(MODELS)
    return stack.client.post(route, json=GOOD[route])


# ---- the test ------------------------------------------------------------------------------
def test_matrix_is_big_and_covers_every_route() -> None:
    assert len(CASES) >= 100
    assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"
    assert {*POST_ROUTES, MODELS} <= {c.path for c in CASES}
    assert all(400 <= c.status < 500 for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gets_4xx_envelope_and_worker_keeps_serving(stack: Stack, case: Case) -> None:
    reply = raw_request(stack, case)
    text = reply.body.decode("utf-8", "replace")
    assert reply.status == case.status, f"{case.id}: {reply.status} {text[:600]}"
    assert reply.headers.get("content-type", "").startswith("application/json"), reply.headers
    body = json.loads(reply.body)
    assert isinstance(body, dict) and set(body) == {"error"}, text[:600]
    error = body["error"]
    assert isinstance(error.get("message"), str) and error["message"], text[:600]
    assert isinstance(error.get("type"), str) and error["type"], text[:600]
    assert {"param", "code"} <= set(error), text[:600]
    if reply.status in (400, 401, 404, 405, 413):
        assert error["type"] == "invalid_request_error", text[:600]
    if case.param is not None:
        assert error["param"] == case.param, text[:600]
    if case.code is not None:
        assert error["code"] == case.code, text[:600]
    if reply.status == 401:
        assert reply.headers.get("www-authenticate") == "Bearer", reply.headers
    assert not LEAK.search(text), f"{case.id} leaks internals: {text[:600]}"
    assert len(reply.body) < 4096, f"{case.id}: error body of {len(reply.body)} bytes"

    ok = good_request(stack, case.good)
    assert ok.status_code == 200, f"after {case.id}: {ok.status_code} {ok.text[:600]}"
    assert stack.ivy.poll() is None, "ivy exited"
    assert all(t.poll() is None for t in stack.tulips), "a replica exited"


@pytest.mark.parametrize(
    "fields",
    [
        {"tool_choice": "none", "tools": [], "functions": [], "function_call": "auto"},
        {"response_format": {"type": "text"}, "top_logprobs": 0, "logprobs": False},
        {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}},
        {"metadata": {"team": "search"}, "store": False, "service_tier": "auto"},  # harmless
        {"logprobs": True, "top_logprobs": 20},  # served (the most alternatives)
        {"presence_penalty": 2, "frequency_penalty": -2},  # served (OpenAI's bounds)
        {"logit_bias": {"0": -100, "49151": 100}},  # served (the vocabulary's ends)
    ],
    ids=[
        "tools-off",
        "text-format",
        "no-penalties",
        "harmless-unknown",
        "logprobs",
        "penalties",
        "logit-bias",
    ],
)
def test_no_op_values_and_harmless_unknown_fields_are_accepted(
    stack: Stack, fields: dict[str, Any]
) -> None:
    r = stack.client.post(CHAT, json={**GOOD[CHAT], **fields})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "path", ["/health/live", "/health/ready", "/health", MODELS, "/info", "/metrics"]
)
def test_head_answers_wherever_get_does(stack: Stack, path: str) -> None:
    """RFC 9110: a server that answers GET answers HEAD, with GET's status and headers and
    no body; a wrong method's 405 lists both."""
    get = raw_request(stack, Case(f"get:{path}", "GET", path, 200))
    head = raw_request(stack, Case(f"head:{path}", "HEAD", path, 200))
    assert get.status == head.status == 200, (get.status, head.status, get.body[:300])
    assert head.body == b"" and get.body
    assert head.headers["content-type"] == get.headers["content-type"]
    if path != "/metrics":  # the metrics text grows between the two requests
        assert head.headers["content-length"] == get.headers["content-length"] == str(len(get.body))
    post = raw_request(stack, Case(f"post:{path}", "POST", path, 405, body=b"{}"))
    assert post.status == 405 and post.headers["allow"] == "GET, HEAD", post.headers


@pytest.mark.parametrize(
    ("path", "body", "param", "where"),
    [
        ("/v2/rerank", {"query": "q", "documents": [{"text": 5}]}, "documents", "documents.0.text"),
        (CHAT, {"messages": [{"role": "user", "content": []}]}, "messages", "messages.0.content"),
        ("/decode", {"ids": [[]]}, "ids", "ids.0"),
    ],
    ids=["rerank-document-text", "chat-empty-content", "decode-empty-row"],
)
def test_a_value_that_fits_no_union_member_is_located_by_its_own_fields(
    stack: Stack, path: str, body: dict[str, Any], param: str, where: str
) -> None:
    """A field that takes a string or an object (or lists of either) fails once per member;
    the message names the place in the request, not pydantic's member names ('str',
    'list[constrained-int]')."""
    good = GOOD.get(path, {"model": E5} if path != CHAT else GOOD[CHAT])
    r = stack.client.post(path, json={"model": good["model"], **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and f"Invalid '{where}':" in error["message"], error
