"""Tulip's streaming Generate RPC, end to end: real `python -m tulip` processes serving the
real SmolLM2-135M-Instruct weights (`rose.assets`), real gRPC on loopback.

Oracles: token ids from `rose.generate.GenerationEngine` run in this process on the same
weights (batch 1, greedy) and from `transformers` greedy `generate`; text from the HF
`tokenizers` decode of those ids. Three servers start in parallel: a plain one, one with
n-gram speculation (which is drained with SIGTERM by the last test) and one drafting MTP
draft trees (`--spec-tree`) with an untrained head, which must change nothing.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import tokenizers

from protos.trellis.v1 import inference_pb2 as pb
from tulip.client import TulipClient, embed_request, generate_request
from tulip.config import ConfigError, TulipConfig
from tulip.generation import spec_config
from tulip.process import Samples, TulipProcess
from tulip.textstream import TextStream

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QUESTIONS = [
    "What is the capital of France?",
    "List three prime numbers.",
    "Why is the sky blue?",
    "Write a haiku about rain.",
]
QUOTE = (
    "Context: Honey never spoils because its low moisture and high acidity stop bacteria "
    "from growing.\n\nRepeat the context word for word."
)
MAX_TOKENS = 10
SAMPLED = "sampled: temperature 0.8, top_k 50, top_p 0.9, seed 7"
KV_PAGES = 128  # x 16 tokens: 2048 tokens of KV cache per server
VOCAB = 49152
CONTEXT = 8192


def chat(question: str, tok: tokenizers.Tokenizer) -> list[int]:
    text = (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    return list(tok.encode(text).ids)


# -- fixtures --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    from rose.assets import ensure_model

    return Path(ensure_model("smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def tok(smol_dir: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(smol_dir / "tokenizer.json"))


def decode(tok: tokenizers.Tokenizer, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def servers(
    smol_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TulipProcess, TulipProcess, TulipProcess]]:
    """(plain, ngram, mtp-tree) servers, started together so their model loads overlap."""
    import torch

    from rose.models.llama import LlamaConfig
    from rose.spec.mtp import MTPHead, MTPHeadConfig

    logs = tmp_path_factory.mktemp("tulip-generate")
    head_dir = tmp_path_factory.mktemp("mtp-head")
    torch.manual_seed(0)
    cfg = LlamaConfig.from_file(smol_dir / "config.json")
    MTPHead(MTPHeadConfig.for_target(cfg, draft_vocab_size=256)).save(head_dir)
    common = [
        *("--model", str(smol_dir), "--kv-pages", str(KV_PAGES), "--max-running-seqs", "8"),
        *("--threads", "1"),  # two servers and the test share the CPU cores
    ]
    plain = TulipProcess(common, log_path=logs / "plain.log")
    ngram = TulipProcess(
        [*common, "--spec", "ngram", "--spec-draft-tokens", "4", "--drain-seconds", "60"],
        log_path=logs / "ngram.log",
    )
    tree = TulipProcess(
        [
            *common,
            *("--spec", "mtp", "--mtp-head", str(head_dir)),
            *("--spec-draft-tokens", "2", "--spec-tree", "3,2"),
            *("--spec-lookup", "0"),  # the head drafts every step: every step a tree
        ],
        log_path=logs / "mtp-tree.log",
    )
    with plain, ngram, tree:
        plain.wait_serving()
        ngram.wait_serving()
        tree.wait_serving()
        yield plain, ngram, tree
        assert plain.stop() == 0, plain.log_tail()
        assert ngram.stop() == 0, ngram.log_tail()
        assert tree.stop() == 0, tree.log_tail()


@pytest.fixture(scope="module")
def server(servers: tuple[TulipProcess, TulipProcess, TulipProcess]) -> TulipProcess:
    return servers[0]


@pytest.fixture(scope="module")
def reference(smol_dir: Path, tok: tokenizers.Tokenizer) -> dict[str, tuple[list[int], str]]:
    """Greedy ids and finish reason of every prompt, from GenerationEngine in this process."""
    from rose.generate import GenerationEngine
    from rose.models.llama import LlamaForCausalLM
    from rose.sampling import SamplingParams

    model = LlamaForCausalLM.from_pretrained(smol_dir)
    engine = GenerationEngine(model, eos_ids=model.config.eos_token_ids)
    questions = [*QUESTIONS, QUOTE]
    results = engine.generate([chat(q, tok) for q in questions], SamplingParams(MAX_TOKENS))
    out = {q: (r.output_ids, r.finish_reason) for q, r in zip(questions, results, strict=True)}
    sampled = SamplingParams(MAX_TOKENS, temperature=0.8, top_k=50, top_p=0.9, seed=7)
    [result] = engine.generate([chat(QUESTIONS[3], tok)], sampled)
    out[SAMPLED] = (result.output_ids, result.finish_reason)
    return out


LIMITED = pb.SamplingOptions(max_tokens=MAX_TOKENS)


async def collect(
    client: TulipClient, prompt: list[int], sampling: pb.SamplingOptions | None = LIMITED
) -> list[pb.GenerateResponse]:
    return [r async for r in client.generate(prompt, sampling, timeout=120)]


def collect_all(server: TulipProcess, prompts: list[list[int]]) -> list[list[pb.GenerateResponse]]:
    """Every prompt's greedy stream from ``server``, all requests in flight at once."""

    async def main() -> list[list[pb.GenerateResponse]]:
        async with TulipClient(server.target) as client:
            return await asyncio.gather(*(collect(client, p) for p in prompts))

    return asyncio.run(main())


def ids_of(responses: list[pb.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def text_of(responses: list[pb.GenerateResponse]) -> str:
    return "".join(r.text for r in responses)


def check_last(responses: list[pb.GenerateResponse], prompt_len: int) -> pb.GenerateResponse:
    """Only the last message is finished, and it carries usage and timing."""
    *body, last = responses
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in body)
    assert last.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert last.usage.prompt_tokens == prompt_len
    assert last.usage.completion_tokens == len(ids_of(responses))
    assert last.timing.inference_us > 0
    return last


def sample(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def wait_idle(server: TulipProcess, timeout: float = 20.0) -> Samples:
    """Poll the metrics until the engine holds no sequence and every KV page is free."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = sample(m, "tulip_active_sequences") == 0
        if idle and sample(m, "tulip_kv_pages_free") == sample(m, "tulip_kv_pages") == KV_PAGES:
            return m
        assert time.monotonic() < deadline, f"engine not idle: {m}"
        await asyncio.sleep(0.1)


# -- configuration and text deltas (no server) -----------------------------------------


def test_generation_flags_and_env() -> None:
    env = {"TULIP_SPEC": "ngram", "TULIP_SPEC_DRAFT_TOKENS": "6", "TULIP_KV_PAGES": "64"}
    config = TulipConfig.from_args(["--model", "m", "--max-running-seqs", "4"], env)
    assert (config.spec, config.spec_draft_tokens, config.kv_pages) == ("ngram", 6, 64)
    assert (config.max_running_seqs, config.kv_page_size) == (4, 16)
    default = TulipConfig.from_args(["--model", "m"], {})
    assert (default.spec, default.kv_pages, default.max_running_seqs) == ("none", 0, 32)
    draft = TulipConfig.from_args(["--model", "m", "--spec", "draft", "--draft-layers", "6"])
    assert draft.draft_layers == 6
    assert draft.spec_tree_widths == ()
    tree = TulipConfig.from_args(
        ["--model", "m", "--spec", "mtp", "--mtp-head", "h", "--spec-draft-tokens", "2"],
        {"TULIP_SPEC_TREE": "3,2"},
    )
    assert tree.spec_tree_widths == (3, 2)
    dynamic = TulipConfig.from_args(
        ["--model", "m", "--spec", "mtp", "--mtp-head", "h", "--spec-tree-nodes", "5"], {}
    )
    assert (dynamic.spec_tree_nodes, dynamic.spec_tree_widths) == (5, ())
    stop = TulipConfig.from_args(
        ["--model", "m", "--spec", "mtp", "--mtp-head", "h"], {"TULIP_SPEC_CHAIN_MIN_PROB": "0.2"}
    )
    assert stop.spec_chain_min_prob == 0.2
    assert default.prefix_cache
    assert not TulipConfig.from_args(["--model", "m", "--no-prefix-cache"], {}).prefix_cache
    assert not TulipConfig.from_args(["--model", "m"], {"TULIP_PREFIX_CACHE": "0"}).prefix_cache


def test_spec_draft_defaults_by_method() -> None:
    """``--spec ngram`` drafts up to 16 tokens, 4 per token of the matched suffix, unless
    told otherwise; the other methods draft a fixed 4 (mtp: its default tree's 3 deep);
    either default yields to the flags and TULIP_* variables."""

    def resolved(argv: list[str], env: dict[str, str] | None = None) -> tuple[int, int, bool]:
        config = TulipConfig.from_args(["--model", "m", *argv], env or {})
        return config.draft_tokens, config.ngram_per_match, config.spec_adaptive

    assert resolved(["--spec", "ngram"]) == (16, 4, False)
    assert resolved(["--spec", "ngram", "--spec-ngram-per-match", "0"]) == (4, 0, False)
    assert resolved(["--spec", "ngram"], {"TULIP_SPEC_NGRAM_PER_MATCH": "0"}) == (4, 0, False)
    assert resolved(["--spec", "ngram", "--spec-ngram-per-match", "2"]) == (16, 2, False)
    assert resolved(["--spec", "ngram", "--spec-draft-tokens", "8"]) == (8, 4, False)
    assert resolved(["--spec", "ngram", "--spec-adaptive"]) == (16, 4, True)
    assert resolved(["--spec", "ngram", "--spec-ngram-per-match", "0", "--spec-adaptive"]) == (
        16,
        0,
        True,
    )
    assert resolved(["--spec", "draft", "--draft-layers", "2"]) == (4, 0, False)
    assert resolved(["--spec", "draft", "--draft-layers", "2"], {"TULIP_SPEC_ADAPTIVE": "1"}) == (
        4,
        0,
        True,
    )
    assert resolved(["--spec", "mtp", "--mtp-head", "h"]) == (3, 0, False)
    assert resolved([]) == (4, 0, False)
    spec = spec_config(TulipConfig.from_args(["--model", "m", "--spec", "ngram"], {}))
    assert (spec.method, spec.num_draft_tokens, spec.ngram_draft_per_match, spec.adaptive_k) == (
        "ngram",
        16,
        4,
        False,
    )
    with pytest.raises(ConfigError, match="--spec-ngram-per-match is only used with --spec ngram"):
        TulipConfig.from_args(
            [
                "--model",
                "m",
                "--spec",
                "draft",
                "--draft-layers",
                "2",
                "--spec-ngram-per-match",
                "2",
            ],
            {},
        )
    with pytest.raises(ConfigError, match="--spec-ngram-per-match must be >= 0"):
        TulipConfig.from_args(["--model", "m", "--spec", "ngram", "--spec-ngram-per-match=-1"], {})


def test_spec_mtp_drafts_a_dynamic_tree_by_default() -> None:
    """``--spec mtp`` alone drafts a dynamic tree of 3 nodes up to 3 deep; --spec-tree-nodes 0
    asks for chains, and --spec-tree / --spec-chain-min-prob shape the drafts instead, so
    the default tree steps aside for them (its depth with it)."""

    def spec(argv: list[str], env: dict[str, str] | None = None) -> tuple[int, int, tuple]:
        config = TulipConfig.from_args(["--model", "m", "--mtp-head", "h", *argv], env or {})
        s = spec_config(config)
        return s.num_draft_tokens, s.tree_nodes, s.tree_widths

    assert spec(["--spec", "mtp"]) == (3, 3, ())
    assert spec(["--spec", "mtp", "--spec-draft-tokens", "5"]) == (5, 3, ())
    assert spec(["--spec", "mtp", "--spec-tree-nodes", "0"]) == (4, 0, ())
    assert spec(["--spec", "mtp"], {"TULIP_SPEC_TREE_NODES": "0"}) == (4, 0, ())
    assert spec(["--spec", "mtp", "--spec-tree-nodes", "5"]) == (4, 5, ())
    assert spec(["--spec", "mtp", "--spec-tree", "3,2"]) == (4, 0, (3, 2))
    config = TulipConfig.from_args(
        ["--model", "m", "--mtp-head", "h", "--spec", "mtp", "--spec-chain-min-prob", "0.15"]
    )
    s = spec_config(config)
    assert (s.num_draft_tokens, s.tree_nodes, s.chain_min_prob) == (4, 0, 0.15)
    plain = TulipConfig.from_args(["--model", "m", "--spec", "ngram"], {})
    assert plain.tree_nodes == 0
    assert spec_config(plain).lookup_min_match == 0


def test_spec_mtp_copies_long_repeats_by_default() -> None:
    """``--spec mtp`` alone copies from the context on a repeat of 2+ tokens (5 drafts at
    most); --spec-lookup sets the match, 0 turns it off, --spec-lookup-drafts the copy."""

    def lookup(argv: list[str], env: dict[str, str] | None = None) -> tuple[int, int, int]:
        config = TulipConfig.from_args(["--model", "m", "--mtp-head", "h", *argv], env or {})
        s = spec_config(config)
        return s.lookup_min_match, s.lookup_drafts, s.max_fed_drafts

    assert lookup(["--spec", "mtp"]) == (2, 5, 5)
    assert lookup(["--spec", "mtp", "--spec-lookup", "3", "--spec-lookup-drafts", "8"]) == (
        3,
        8,
        8,
    )
    assert lookup(["--spec", "mtp"], {"TULIP_SPEC_LOOKUP": "0"}) == (0, 5, 3)


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (["--spec", "medusa"], "--spec"),
        (["--spec", "draft"], "--spec draft"),
        (["--spec", "draft", "--draft-model", "d", "--draft-layers", "2"], "--spec draft"),
        (["--draft-model", "d"], "--draft-model"),
        (["--spec", "mtp"], "--mtp-head"),
        (["--mtp-head", "h"], "--mtp-head"),
        (["--spec-draft-tokens", "-1"], "--spec-draft-tokens"),
        (["--spec", "mtp", "--mtp-head", "h", "--spec-adaptive"], "--spec-adaptive"),
        (["--spec-adaptive"], "--spec-adaptive"),
        (["--spec-tree", "2"], "--spec-tree"),
        (["--spec-tree-nodes", "4"], "--spec-tree-nodes"),
        (["--spec", "mtp", "--mtp-head", "h", "--spec-tree-nodes", "-1"], "--spec-tree-nodes"),
        (
            ["--spec", "mtp", "--mtp-head", "h", "--spec-tree-nodes", "4", "--spec-tree", "2"],
            "--spec-tree-nodes",
        ),
        (["--spec-chain-min-prob", "0.2"], "--spec-chain-min-prob"),
        (["--spec", "ngram", "--spec-lookup", "2"], "--spec-lookup"),
        (["--spec", "mtp", "--mtp-head", "h", "--spec-lookup", "5"], "--spec-lookup"),
        (["--spec", "mtp", "--mtp-head", "h", "--spec-lookup-drafts", "0"], "--spec-lookup-drafts"),
        (
            ["--spec", "mtp", "--mtp-head", "h", "--spec-chain-min-prob", "1"],
            "--spec-chain-min-prob",
        ),
        (
            [
                "--spec",
                "mtp",
                "--mtp-head",
                "h",
                "--spec-chain-min-prob",
                "0.2",
                "--spec-tree",
                "2",
            ],
            "--spec-chain-min-prob",
        ),
        (["--spec", "mtp", "--mtp-head", "h", "--spec-tree", "3,x"], "--spec-tree"),
        (["--spec", "mtp", "--mtp-head", "h", "--spec-tree", "3,0"], "--spec-tree"),
        (
            ["--spec", "mtp", "--mtp-head", "h", "--spec-draft-tokens", "1", "--spec-tree", "2,2"],
            "--spec-tree",
        ),
        (["--max-running-seqs", "0"], "--max-running-seqs"),
        (["--kv-pages", "-1"], "--kv-pages"),
        (["--kv-page-size", "0"], "--kv-page-size"),
    ],
)
def test_invalid_generation_flags_name_the_flag(argv: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        TulipConfig.from_args(["--model", "m", *argv], {})
    assert key in str(caught.value)


@pytest.mark.parametrize("stop", [(), ("\n\n",), ("🎉",), ("Mär",), ("ß e", "日本"), ("zz",)])
def test_text_deltas_add_up_to_the_decoded_text(tok: tokenizers.Tokenizer, stop: tuple) -> None:
    text = "Grüße aus Köln! 日本語のテキスト 🎉🎉 Märchen — ßeta\n\nnext ✓ 😀 end"
    ids = tok.encode(text).ids
    full = decode(tok, ids)
    cut = min((full.find(s) for s in stop if s in full), default=len(full))
    for seed in range(10):
        rng = random.Random(seed)
        stream = TextStream(lambda x: decode(tok, x), stop)
        pieces, i = [], 0
        while i < len(ids):
            n = rng.randint(1, 3)
            last = i + n >= len(ids)
            pieces.append(stream.push(ids[i : i + n], "stop" if last else None))
            emitted = "".join(pieces)
            assert "\ufffd" not in emitted  # no half character is ever sent
            assert full.startswith(emitted)
            if not last:  # nothing that may still turn into a stop string is sent
                assert len(emitted) <= cut
            i += n
        assert "".join(pieces) == full[:cut]


def test_length_finish_flushes_held_back_text(tok: tokenizers.Tokenizer) -> None:
    ids = tok.encode("Hello wor").ids
    stream = TextStream(lambda x: decode(tok, x), (" world",))
    assert stream.push(ids[:-1]) == "Hello"
    assert stream.push(ids[-1:]) == ""  # " wor" may still become " world"
    assert stream.push([], "length") == " wor"


# -- the backend in this process (a tiny random-weight Llama) ----------------------------


def tiny_generator(positions: int = 128) -> Any:  # noqa: ANN401 - LlamaForCausalLM
    """A random 2-layer Llama over 64 tokens (seed 0): fast enough to step by hand."""
    import torch

    from rose.models.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=positions,
    )
    return LlamaForCausalLM(cfg).eval()


def tiny_backend(engine: Any, positions: int = 128, **kw: Any) -> Any:  # noqa: ANN401
    """A `GenerationBackend` serving ``engine`` as the tiny model (ids decode to digits)."""
    from tulip.generation import GenerationBackend
    from tulip.inputs import ModelLimits
    from tulip.service import ServedModel

    limits = ModelLimits("generator", 64, positions, 0, False)
    served = ServedModel("tiny", limits, pb.InfoResponse(kind=pb.MODEL_KIND_GENERATOR))
    return GenerationBackend(engine, lambda ids: " ".join(map(str, ids)), served, **kw)


def test_backend_batches_streams_and_returns_pages_of_closed_ones() -> None:

    from rose.generate import GenerationConfig, GenerationEngine
    from rose.kv.allocator import KVCacheConfig
    from rose.sampling import SamplingParams
    from tulip.errors import Draining, Overloaded
    from tulip.inputs import GenerateWork
    from tulip.metrics import Metrics

    model = tiny_generator(128)
    engine = GenerationEngine(model, GenerationConfig(KVCacheConfig(num_pages=40, page_size=4)))
    backend = tiny_backend(engine, max_queued_tokens=10)
    prompts = [[1, 2, 3], [7, 8], [9, 10, 11, 12, 13]]
    want = GenerationEngine(model).generate(prompts, SamplingParams(max_tokens=6))

    def work(prompt: list[int], max_tokens: int) -> GenerateWork:
        return GenerateWork(prompt, max_tokens, 0.0, 1.0, 0, None, (), (), True)

    async def drain(stream: AsyncIterator[pb.GenerateResponse]) -> list[int]:
        return [t async for r in stream for t in r.token_ids]

    async def main() -> None:
        backend.start(Metrics())
        try:
            got = await asyncio.gather(*(drain(backend.submit(work(p, 6))) for p in prompts))
            assert got == [r.output_ids for r in want]
            long = [backend.submit(work(p, 100)) for p in (prompts[2], prompts[0])]
            # prompt tokens waiting for their first response are capped (10 here): 5 + 3 + 5
            with pytest.raises(Overloaded):
                backend.submit(work(prompts[2], 100))
            assert (await anext(long[0])).token_ids  # its 5 tokens leave the queue
            long.append(backend.submit(work(prompts[1], 100)))  # 3 + 2 queued now
            for stream in long[1:]:
                assert (await anext(stream)).token_ids
            assert backend.num_sequences == 3 and backend.free_pages < backend.total_pages
            for stream in long:
                stream.close()  # what the service does when the client goes away
            deadline = time.monotonic() + 10
            while backend.num_sequences or backend.free_pages != backend.total_pages:
                assert time.monotonic() < deadline, (backend.num_sequences, backend.free_pages)
                await asyncio.sleep(0.01)
            backend.close_admission()
            with pytest.raises(Draining):
                backend.submit(work(prompts[0], 2))
            assert await backend.drain(1.0)
        finally:
            backend.close()

    asyncio.run(main())


def test_a_stream_whose_draw_fails_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """One sequence's draw raising in the engine (NaN probabilities once did, for a whole
    batch: every stream got INTERNAL) ends that stream with EngineFailed; the greedy streams
    decoded in the same steps finish as the engine alone gives them, and pages come back."""

    from tiny_configs import fail_draws_of_seed

    from rose.generate import GenerationConfig, GenerationEngine
    from rose.kv.allocator import KVCacheConfig
    from rose.sampling import SamplingParams
    from tulip.errors import EngineFailed
    from tulip.inputs import GenerateWork
    from tulip.metrics import Metrics

    model = tiny_generator(128)
    prompts = [[1, 2, 3], [7, 8], [9, 10, 11, 12, 13]]
    want = GenerationEngine(model).generate(prompts[:2], SamplingParams(max_tokens=6))
    fail_draws_of_seed(monkeypatch)  # seed 13
    engine = GenerationEngine(model, GenerationConfig(KVCacheConfig(num_pages=40, page_size=4)))
    backend = tiny_backend(engine)

    def work(prompt: list[int], temperature: float, seed: int | None) -> GenerateWork:
        return GenerateWork(prompt, 6, temperature, 1.0, 0, seed, (), (), True)

    async def drain(stream: AsyncIterator[pb.GenerateResponse]) -> list[int] | Exception:
        try:
            return [t async for r in stream for t in r.token_ids]
        except EngineFailed as error:
            return error

    async def main() -> None:
        backend.start(Metrics())
        try:
            works = [work(prompts[0], 0.0, None), work(prompts[2], 1.0, 13)]
            works.append(work(prompts[1], 0.0, None))
            streams = asyncio.gather(*(drain(backend.submit(w)) for w in works))
            got = await asyncio.wait_for(streams, 60)  # a stream left hanging fails here
            assert got[0] == want[0].output_ids and got[2] == want[1].output_ids, got
            assert isinstance(got[1], EngineFailed) and "inf, nan" in str(got[1])
            deadline = time.monotonic() + 10
            while backend.num_sequences or backend.free_pages != backend.total_pages:
                assert time.monotonic() < deadline, (backend.num_sequences, backend.free_pages)
                await asyncio.sleep(0.01)
        finally:
            backend.close()

    asyncio.run(main())


def test_a_slow_grammar_compile_does_not_hold_up_other_streams() -> None:
    """A json_schema's compile (seconds for a large schema) runs in a worker before the
    request reaches the engine thread, so plain streams keep decoding meanwhile; the
    engine's own compile of it is then a cache hit (here: a refusal, answered
    INVALID_ARGUMENT)."""
    import threading

    from rose.generate import GenerationConfig, GenerationEngine
    from rose.grammar import GrammarError, JsonFormat
    from tulip.errors import InvalidInput
    from tulip.inputs import GenerateWork
    from tulip.metrics import Metrics

    class SlowGrammars:
        """The first compile lasts until the test releases it (at most 30 s)."""

        def __init__(self) -> None:
            self.threads: list[str] = []
            self.release = threading.Event()
            self.released_in_time: bool | None = None

        def state(self, fmt: JsonFormat) -> None:
            self.threads.append(threading.current_thread().name)
            if len(self.threads) == 1:  # a cold compile
                self.released_in_time = self.release.wait(30)
            raise GrammarError("json_schema: refused")

    grammars = SlowGrammars()
    engine = GenerationEngine(tiny_generator(256), GenerationConfig(), grammars=grammars)  # type: ignore[arg-type]
    backend = tiny_backend(engine, 256)
    plain = GenerateWork([1, 2, 3], 120, 0.0, 1.0, 0, None, (), (), True)
    constrained = GenerateWork([4, 5], 4, 0.0, 1.0, 0, None, (), (), False, JsonFormat("{}"))

    async def main() -> None:
        backend.start(Metrics())
        try:
            slow = backend.submit(constrained)
            stream = backend.submit(plain)
            got = [t async for r in stream for t in r.token_ids]
            grammars.release.set()  # the plain stream is done: let the compile end
            with pytest.raises(InvalidInput, match="refused"):
                await anext(slow)
            assert len(got) == 120
            # the plain stream finished while the compile still ran (on the engine thread
            # it could not have: the compile would have timed out first) ...
            assert grammars.released_in_time is True
            # ... in a worker; the engine thread compiled it (again) afterwards
            worker, engine_thread = grammars.threads
            assert worker != engine_thread
        finally:
            backend.close()

    asyncio.run(main())


def test_generator_steps_have_a_token_budget_by_default() -> None:
    from tulip.generation import step_tokens

    def config(*flags: str) -> TulipConfig:
        return TulipConfig.from_args(["--model", "m", *flags], {})

    assert step_tokens(config(), "cpu") == 512
    assert step_tokens(config(), "cuda:0") == 2048
    assert step_tokens(config("--max-batch-tokens", "4096"), "cpu") == 4096
    assert step_tokens(config("--max-batch-tokens", "8", "--max-running-seqs", "16"), "cpu") == 16


def test_a_long_prompt_is_prefilled_in_chunks_while_its_neighbour_decodes() -> None:
    """Under a step budget a long prompt's prefill takes several steps, and a stream already
    decoding gets a token in each of them: it is not held up for the whole prefill."""

    from rose.generate import GenerationConfig, GenerationEngine
    from rose.sampling import SamplingParams
    from tulip.inputs import GenerateWork
    from tulip.metrics import Metrics

    model = tiny_generator(512)
    long_prompt = [1 + i % 60 for i in range(320)]
    want = GenerationEngine(model).generate([long_prompt], SamplingParams(max_tokens=4))
    engine = GenerationEngine(model, GenerationConfig(max_batch=4, max_step_tokens=32))
    backend = tiny_backend(engine, 512)
    events: list[str] = []

    async def follow(name: str, stream: AsyncIterator[pb.GenerateResponse]) -> list[int]:
        ids = []
        async for r in stream:
            events.extend([name] * len(r.token_ids))
            ids += r.token_ids
        return ids

    async def main() -> None:
        backend.start(Metrics())
        try:
            near = backend.submit(GenerateWork([1, 2, 3], 40, 0.0, 1.0, 0, None, (), (), True))
            first = await anext(near)  # decoding before the long prompt arrives
            far = backend.submit(GenerateWork(long_prompt, 4, 0.0, 1.0, 0, None, (), (), True))
            got = await asyncio.gather(follow("near", near), follow("far", far))
            assert got[1] == want[0].output_ids  # chunked prefill changes no token
            assert len(first.token_ids) + len(got[0]) == 40
            # 320 prompt tokens in steps of at most 32 (the neighbour's decode among them):
            # the neighbour emitted in every step before the long prompt's first token
            assert events.index("far") >= 320 // 32, events
        finally:
            backend.close()

    asyncio.run(main())


def test_generate_is_unavailable_until_a_model_is_attached() -> None:
    from protos.trellis.v1 import inference_pb2_grpc as pb_grpc
    from tulip.metrics import Metrics
    from tulip.service import InferenceService

    metrics = Metrics()

    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_InferenceServicer_to_server(InferenceService(metrics), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with TulipClient(f"127.0.0.1:{port}") as client:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await collect(client, [1, 2, 3])
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "still loading" in (caught.value.details() or "")
        finally:
            await server.stop(None)

    asyncio.run(main())
    labels = {"method": "Generate", "status": "UNAVAILABLE"}
    assert metrics.registry.get_sample_value("tulip_requests_total", labels) == 1


# -- the plain server ------------------------------------------------------------------


def test_info_says_generator_and_encoder_rpcs_are_refused(server: TulipProcess) -> None:
    async def main() -> None:
        async with TulipClient(server.target) as client:
            info = await client.info(timeout=30)
            assert info.kind == pb.MODEL_KIND_GENERATOR
            assert (info.vocab_size, info.max_input_tokens) == (VOCAB, CONTEXT)
            assert info.model_name == "smollm2-135m-instruct"
            for call in (
                client.stub.Embed(embed_request([[1, 2]]), timeout=30),
                client.stub.Score(pb.ScoreRequest(), timeout=30),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "generator" in (caught.value.details() or "")

    asyncio.run(main())


def test_streamed_greedy_equals_engine_transformers_and_hf_decode(
    server: TulipProcess,
    smol_dir: Path,
    tok: tokenizers.Tokenizer,
    reference: dict[str, tuple[list[int], str]],
) -> None:
    import torch
    import transformers

    async def main() -> dict[str, list[pb.GenerateResponse]]:
        async with TulipClient(server.target) as client:
            got = {q: await collect(client, chat(q, tok)) for q in QUESTIONS[1:3]}
            # no options at all: greedy, up to the context (this answer ends with EOS)
            got[QUESTIONS[0]] = await collect(client, chat(QUESTIONS[0], tok), None)
            return got

    assert reference[QUESTIONS[0]][1] == "stop"
    got = asyncio.run(main())
    for question, responses in got.items():
        want_ids, want_reason = reference[question]
        assert ids_of(responses) == want_ids, question
        assert len(responses) >= len(want_ids)  # streamed: one message per step
        last = check_last(responses, len(chat(question, tok)))
        reason = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}
        assert last.finish_reason == reason[want_reason]
        assert text_of(responses) == decode(tok, want_ids)
    assert "Paris" in text_of(got[QUESTIONS[0]])

    hf = transformers.AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    prompt = chat(QUESTIONS[0], tok)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=2
        )
    hf_ids = [t for t in out[0, len(prompt) :].tolist() if t != 2]
    assert ids_of(got[QUESTIONS[0]]) == hf_ids


def test_a_repeated_prompt_prefix_is_served_from_the_prefix_cache(
    server: TulipProcess,
    tok: tokenizers.Tokenizer,
    reference: dict[str, tuple[list[int], str]],
) -> None:
    """The same chat prompt twice, one after the other: the second one's prefill starts
    after its cached pages (counted in the metrics), and both answers are the reference's."""
    prompt = chat(QUESTIONS[2], tok)

    async def main() -> list[list[pb.GenerateResponse]]:
        async with TulipClient(server.target) as client:
            first = await collect(client, prompt)
            await wait_idle(server)
            before = server.metrics()
            second = await collect(client, prompt)
            after = await wait_idle(server)
            hit = "tulip_prefix_cache_hit_tokens_total"
            queried = "tulip_prefix_cache_queried_tokens_total"
            # every whole page but the one holding the last prompt token
            assert sample(after, hit) - sample(before, hit) == (len(prompt) - 1) // 16 * 16
            assert sample(after, queried) - sample(before, queried) == len(prompt)
            assert sample(after, "tulip_prefix_cache_pages") >= len(prompt) // 16
            return [first, second]

    for responses in asyncio.run(main()):
        assert ids_of(responses) == reference[QUESTIONS[2]][0]


def test_max_tokens_finishes_with_length(server: TulipProcess, tok: tokenizers.Tokenizer) -> None:
    async def main() -> list[pb.GenerateResponse]:
        async with TulipClient(server.target) as client:
            sampling = pb.SamplingOptions(max_tokens=3, ignore_eos=True)
            return await collect(client, chat(QUESTIONS[2], tok), sampling)

    responses = asyncio.run(main())
    assert len(ids_of(responses)) == 3
    assert check_last(responses, len(chat(QUESTIONS[2], tok))).finish_reason == (
        pb.FINISH_REASON_LENGTH
    )


def test_seeded_sampling_equals_the_engine_with_that_seed(
    server: TulipProcess, tok: tokenizers.Tokenizer, reference: dict[str, tuple[list[int], str]]
) -> None:
    options = pb.SamplingOptions(
        max_tokens=MAX_TOKENS, temperature=0.8, top_k=50, top_p=0.9, seed=7
    )

    async def main() -> list[list[pb.GenerateResponse]]:
        async with TulipClient(server.target) as client:
            return [await collect(client, chat(QUESTIONS[3], tok), options) for _ in range(2)]

    first, second = asyncio.run(main())
    assert ids_of(first) == ids_of(second) == reference[SAMPLED][0]
    assert ids_of(first) != reference[QUESTIONS[3]][0]  # it did sample, not argmax
    assert text_of(first) == decode(tok, reference[SAMPLED][0])


def test_stop_string_cuts_the_text_before_it(
    server: TulipProcess, tok: tokenizers.Tokenizer, reference: dict[str, tuple[list[int], str]]
) -> None:
    question = QUESTIONS[0]
    want_ids, _ = reference[question]
    full = decode(tok, want_ids)
    stop = "of Fr"  # spans the tokens " of" and " France"
    assert stop in full, full
    # the engine stops after the token that completes the stop string
    n = next(i for i in range(1, len(want_ids) + 1) if stop in decode(tok, want_ids[:i]))

    async def main() -> list[pb.GenerateResponse]:
        async with TulipClient(server.target) as client:
            sampling = pb.SamplingOptions(max_tokens=MAX_TOKENS, stop=["never-there", stop])
            return await collect(client, chat(question, tok), sampling)

    responses = asyncio.run(main())
    assert ids_of(responses) == want_ids[:n]
    assert check_last(responses, len(chat(question, tok))).finish_reason == pb.FINISH_REASON_STOP
    # " of" was held back (it could begin the stop string), then cut with it
    assert text_of(responses) == full[: full.index(stop)]


def test_concurrent_streams_each_get_their_own_output(
    server: TulipProcess, tok: tokenizers.Tokenizer, reference: dict[str, tuple[list[int], str]]
) -> None:
    questions = [*QUESTIONS, QUOTE]
    before = server.metrics()
    results = collect_all(server, [chat(q, tok) for q in questions])
    for question, responses in zip(questions, results, strict=True):
        assert ids_of(responses) == reference[question][0], question
        assert text_of(responses) == decode(tok, reference[question][0])
    after = server.metrics()
    generated = sum(len(reference[q][0]) for q in questions)
    assert sample(after, "tulip_generated_tokens_total") - sample(
        before, "tulip_generated_tokens_total"
    ) == pytest.approx(generated)
    # continuous batching: fewer engine steps than tokens generated one request at a time
    steps = sample(after, "tulip_generate_step_seconds_count") - sample(
        before, "tulip_generate_step_seconds_count"
    )
    assert steps < generated


def test_cancelled_stream_frees_its_sequence(
    server: TulipProcess, tok: tokenizers.Tokenizer
) -> None:
    prompt = chat(QUESTIONS[3], tok)
    long = pb.SamplingOptions(max_tokens=1000, ignore_eos=True)

    async def main() -> None:
        before = await wait_idle(server)
        async with TulipClient(server.target) as client:
            stream = client.generate(prompt, long, timeout=120)
            got = [await anext(stream), await anext(stream)]
            assert ids_of(got)
            assert sample(server.metrics(), "tulip_active_sequences") == 1
            await stream.aclose()  # the client goes away mid-stream
            await wait_idle(server)
            # a deadline passing mid-stream aborts the sequence as well
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in client.generate(prompt, long, timeout=1.5):
                    pass
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            after = await wait_idle(server)
        labels = {"method": "Generate", "status": "CANCELLED"}
        assert sample(after, "tulip_requests_total", **labels) - sample(
            before, "tulip_requests_total", **labels
        ) == pytest.approx(2)

    asyncio.run(main())


def _request(prompt: bytes | list[int], **sampling: object) -> pb.GenerateRequest:
    request = generate_request(prompt) if isinstance(prompt, list) else pb.GenerateRequest()
    if isinstance(prompt, bytes):
        request.prompt_ids = prompt
    request.sampling.CopyFrom(pb.SamplingOptions(**sampling))  # type: ignore[arg-type]
    return request


INVALID = [
    (_request([]), "prompt_ids: empty"),
    (_request(b"\x01\x00\x00"), "prompt_ids: 3 bytes"),
    (_request([1, VOCAB]), "prompt_ids[1]: token id 49152"),
    (_request([1] * CONTEXT), "prompt_ids: 8192 tokens"),
    (_request([1] * 8000, max_tokens=200), "sampling.max_tokens"),
    (_request([1, 2], temperature=-1.0), "sampling.temperature"),
    (_request([1, 2], temperature=float("nan")), "sampling.temperature"),
    (_request([1, 2], top_p=1.5), "sampling.top_p"),
    (_request([1, 2], stop=["ok", ""]), "sampling.stop[1]"),
    (_request([1, 2], stop=[str(i) for i in range(17)]), "sampling.stop"),
    (_request([1, 2], stop_token_ids=[2, VOCAB + 5]), "sampling.stop_token_ids[1]"),
]


def test_invalid_requests_are_refused_and_the_server_keeps_serving(
    server: TulipProcess, tok: tokenizers.Tokenizer, reference: dict[str, tuple[list[int], str]]
) -> None:
    async def main() -> list[pb.GenerateResponse]:
        async with TulipClient(server.target) as client:
            for request, field in INVALID:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    async for _ in client.stub.Generate(request, timeout=30):
                        pass
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
                assert field in (caught.value.details() or ""), caught.value.details()
            # more KV cache than the whole pool (128 pages x 16 tokens): RESOURCE_EXHAUSTED
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await collect(client, [1, 2, 3], pb.SamplingOptions(max_tokens=4000))
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "KV cache" in (caught.value.details() or "")
            return await collect(client, chat(QUESTIONS[1], tok))

    responses = asyncio.run(main())
    assert ids_of(responses) == reference[QUESTIONS[1]][0]


# -- the n-gram speculation server (drained at the end) ---------------------------------


def test_mtp_draft_trees_give_identical_greedy_output(
    servers: tuple[TulipProcess, TulipProcess, TulipProcess],
    tok: tokenizers.Tokenizer,
    reference: dict[str, tuple[list[int], str]],
) -> None:
    """--spec mtp --spec-tree 3,2 wired through Tulip: every greedy step verifies a tree
    (drafted tokens counted), and the output is the plain engine's."""
    tree = servers[2]
    questions = [QUESTIONS[0], QUESTIONS[2]]
    results = collect_all(tree, [chat(q, tok) for q in questions])
    for question, responses in zip(questions, results, strict=True):
        assert ids_of(responses) == reference[question][0], question
    m = tree.metrics()
    steps = sample(m, "tulip_spec_verify_steps_total", method="mtp")
    drafted = sample(m, "tulip_spec_drafted_tokens_total", method="mtp")
    # the chain: 2 drafts per verified tree (1 when max_tokens leaves room for one)
    assert 0 < steps <= drafted <= 2 * steps


def test_ngram_speculation_gives_identical_greedy_output(
    servers: tuple[TulipProcess, TulipProcess, TulipProcess],
    tok: tokenizers.Tokenizer,
    reference: dict[str, tuple[list[int], str]],
) -> None:
    ngram = servers[1]
    questions = [QUOTE, QUESTIONS[0]]
    results = collect_all(ngram, [chat(q, tok) for q in questions])
    for question, responses in zip(questions, results, strict=True):
        assert ids_of(responses) == reference[question][0], question
        assert text_of(responses) == decode(tok, reference[question][0])
    m = ngram.metrics()
    assert sample(m, "tulip_spec_drafted_tokens_total", method="ngram") > 0
    assert sample(m, "tulip_spec_accepted_tokens_total", method="ngram") > 0
    rate = sample(m, "tulip_spec_acceptance_rate", method="ngram")
    assert 0 < rate <= 1


def test_sigterm_lets_running_streams_finish_and_refuses_new_ones(
    servers: tuple[TulipProcess, TulipProcess, TulipProcess], tok: tokenizers.Tokenizer
) -> None:
    ngram = servers[1]
    prompt = chat(QUESTIONS[2], tok)

    async def main() -> None:
        async with TulipClient(ngram.target) as client:
            sampling = pb.SamplingOptions(max_tokens=40, ignore_eos=True)
            stream = client.generate(prompt, sampling, timeout=120)
            responses = [await anext(stream)]
            ngram.terminate()
            while await client.health(timeout=10) == "SERVING":  # admission closes first
                await asyncio.sleep(0.02)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await collect(client, prompt)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in (caught.value.details() or "")
            responses += [r async for r in stream]
            assert len(ids_of(responses)) == 40
            assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH

    asyncio.run(main())
    assert ngram.process is not None
    assert ngram.process.wait(timeout=60) == 0, ngram.log_tail()
