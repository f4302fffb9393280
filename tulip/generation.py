"""The generation backend: a ROSE `GenerationEngine` driven by one engine thread.

`GenerationEngine` is not thread-safe, so one thread owns it and runs a loop: take the
requests added and aborted since the last step, ``step()`` every running sequence once
(continuous batching: sequences join and leave between steps), turn each sequence's new
ids into a `GenerateResponse` (with its text delta, `tulip.textstream`) and hand it to the
request's asyncio queue with ``loop.call_soon_threadsafe``. With no work the thread sleeps
on a condition variable.

The event loop side is `GenerationStream`: an async iterator of one request's responses.
Closing it before the last response (the client cancelled, or its deadline passed) aborts
the sequence on the engine thread, which returns its KV pages to the pool.

Example (inside the server's event loop)::

    backend = GenerationBackend.load(config, model_dir)
    backend.start(metrics)
    stream = backend.submit(work)          # a validated `tulip.inputs.GenerateWork`
    async for response in stream:          # pb.GenerateResponse, the last one finished
        ...

`rose` and torch are imported only when a model is loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protos.trellis.v1 import inference_pb2 as pb
from tulip.config import TulipConfig
from tulip.errors import Draining, EngineFailed, InvalidInput, Overloaded, TulipError
from tulip.inputs import GenerateWork, ModelLimits
from tulip.metrics import Metrics
from tulip.service import ServedModel
from tulip.textstream import TextStream

if TYPE_CHECKING:
    from rose.generate import GenerationEngine, StepOutput
    from rose.grammar import Grammars, JsonFormat
    from rose.sampling import TokenLogprob
    from rose.spec import SpecConfig

__all__ = [
    "CAUSAL_LM_ARCHITECTURES",
    "GENERATOR_MODEL_TYPES",
    "GenerationBackend",
    "GenerationStream",
    "is_generator",
    "spec_config",
    "step_tokens",
]

CAUSAL_LM_ARCHITECTURES = {
    "granite": "GraniteForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
"""config.json ``model_type`` → the architecture its generators declare (`rose.models.llama`)."""

GENERATOR_MODEL_TYPES = frozenset(CAUSAL_LM_ARCHITECTURES)
"""config.json ``model_type`` values that can be served as generators."""

_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}
_WARMUP_TOKENS = 2
_JOIN_SECONDS = 10.0

log = logging.getLogger("tulip")


def is_generator(model_dir: Path, runner: str = "auto") -> bool:
    """Whether the model directory is served by `GenerationBackend` (else by the encoder
    `tulip.backend.RoseBackend`: embeddings, scores). The one place this is decided.

    ``runner`` (``--runner``) "generate" or "pooling" decides. "auto" reads the directory:
    a generator has a decoder ``model_type`` (`GENERATOR_MODEL_TYPES`), declares its causal
    LM in ``architectures`` (llama and qwen2 ones may declare nothing), and has no
    sentence-transformers ``modules.json``. The same
    ``Qwen3ForCausalLM`` name is shipped by Qwen3-Embedding (modules.json with a Pooling
    module) and Qwen3-Reranker (modules.json ending in a LogitScore module,
    `rose.loading.read_logit_score`): both stay encoders, as do ``Qwen3Model`` and
    ``Qwen3ForSequenceClassification`` directories."""
    if runner != "auto":
        return runner == "generate"
    raw = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    model_type = raw.get("model_type")
    if model_type not in CAUSAL_LM_ARCHITECTURES:
        return False
    if (model_dir / "modules.json").exists():
        return False
    architectures = raw.get("architectures") or []
    if not architectures:
        return model_type in ("llama", "qwen2")
    return list(architectures) == [CAUSAL_LM_ARCHITECTURES[model_type]]


def spec_config(config: TulipConfig) -> SpecConfig:
    """The engine's speculation settings for Tulip's flags (validated by `SpecConfig`)."""
    from rose.spec import SpecConfig

    return SpecConfig(
        method=config.spec,
        num_draft_tokens=config.draft_tokens,
        ngram_draft_per_match=config.ngram_per_match,
        adaptive_k=config.spec_adaptive,
        tree_widths=config.spec_tree_widths,
        tree_nodes=config.tree_nodes,
        chain_min_prob=config.spec_chain_min_prob,
        lookup_min_match=config.lookup_min_match,
        lookup_drafts=config.spec_lookup_drafts,
    )


class _Request:
    """One Generate request. ``cancelled`` is written by the event loop; everything below
    it only by the engine thread."""

    def __init__(self, work: GenerateWork, params: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.work = work
        self.params = params  # rose.sampling.SamplingParams
        self.loop = loop
        self.queue: asyncio.Queue[pb.GenerateResponse | TulipError] = asyncio.Queue()
        self.submitted = time.monotonic()
        self.cancelled = False
        self.queued = True  # event loop only: no response received yet
        self.seq_id: int | None = None
        self.text: TextStream | None = None
        self.first_step: float | None = None
        self.completion_tokens = 0

    def deliver(self, item: pb.GenerateResponse | TulipError) -> None:
        """Hand ``item`` to the request's queue from the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class GenerationStream:
    """The responses of one request, as an async iterator; `close` aborts the request."""

    def __init__(self, backend: GenerationBackend, request: _Request) -> None:
        self._backend = backend
        self._request = request
        self._open = True

    def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]:
        return self

    async def __anext__(self) -> pb.GenerateResponse:
        if not self._open:
            raise StopAsyncIteration
        item = await self._request.queue.get()
        self._backend._dequeued(self._request)
        if isinstance(item, TulipError):
            self._finish(abort=False)
            raise item
        if item.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self._finish(abort=False)
        return item

    def close(self) -> None:
        """Stop listening; an unfinished sequence is aborted and its pages freed."""
        self._finish(abort=True)

    def _finish(self, abort: bool) -> None:
        if self._open:
            self._open = False
            self._backend._closed(self._request, abort)


@dataclass(frozen=True)
class _SpecTotals:
    steps: int = 0
    drafted: int = 0
    accepted: int = 0


# One engine step's token budget when --max-batch-tokens is 0. Prompts are prefilled in
# chunks of it, so a long prompt holds up the streams decoding beside it for one chunk at a
# time (without a budget a 6,000-token prompt held them ~100 s on one CPU thread); a CPU is
# busy with a few hundred tokens per pass, a GPU gains from more.
_CPU_STEP_TOKENS = 512
_GPU_STEP_TOKENS = 2048


def step_tokens(config: TulipConfig, device: str) -> int:
    """`rose.generate.GenerationConfig.max_step_tokens` for a generator on ``device``:
    ``--max-batch-tokens``, else by device; at least ``--max-running-seqs`` (every running
    sequence decodes in each step)."""
    budget = config.max_batch_tokens or (
        _GPU_STEP_TOKENS if device.startswith("cuda") else _CPU_STEP_TOKENS
    )
    return max(budget, config.max_running_seqs)


def _compile(grammars: Grammars, fmt: JsonFormat) -> None:
    """Compile ``fmt`` into ``grammars``' cache; a refusal is the engine's to report."""
    from rose.grammar import GrammarError

    with contextlib.suppress(GrammarError):
        grammars.state(fmt)


class GenerationBackend:
    """One loaded decoder, its `GenerationEngine` and the thread that owns the engine."""

    def __init__(
        self,
        engine: GenerationEngine,
        decode: Callable[[list[int]], str],
        served: ServedModel,
        max_queued_tokens: int = 262144,
    ) -> None:
        self._engine = engine
        self._max_queued_tokens = max_queued_tokens
        self._queued_tokens = 0  # event loop only: prompt tokens of requests not started
        self._decode = decode
        self.served = served
        self.spec_method: str = engine.config.spec.method
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, _Request]] = []  # guarded by _cond
        self._stopping = False  # guarded by _cond
        self._live: dict[int, _Request] = {}  # engine thread only
        self._open = 0  # event loop only: streams not closed yet
        self._idle: asyncio.Event | None = None
        self._closing = False
        self._thread: threading.Thread | None = None
        self._metrics: Metrics | None = None
        self._spec = _SpecTotals()
        self._prefix_seen = (0, 0, 0)  # prefix cache totals already counted (`_record_step`)

    # -- loading -------------------------------------------------------------------------

    @classmethod
    def load(cls, config: TulipConfig, model_dir: Path) -> GenerationBackend:
        """Load the decoder (and drafter / MTP head) for `config`; blocking."""
        import tokenizers
        import torch

        from rose.generate import GenerationConfig, GenerationEngine
        from rose.grammar import Grammars
        from rose.hub import resolve_model
        from rose.kv.allocator import KVCacheConfig
        from rose.models.llama import LlamaForCausalLM
        from rose.spec import truncated_drafter
        from rose.spec.mtp import MTPHead
        from rose.spec.proposer import kv_copies_of

        if config.threads is not None:
            torch.set_num_threads(config.threads)
        device = config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype_name = config.dtype
        if dtype_name == "auto":
            dtype_name = "bfloat16" if device.startswith("cuda") else "float32"
        dtype = getattr(torch, dtype_name)
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype, device=device)
        cfg = model.config
        drafter = None
        head = None
        if config.spec == "draft" and config.draft_layers:
            if config.draft_layers >= cfg.num_hidden_layers:
                raise ValueError(
                    f"--draft-layers must be below the target's {cfg.num_hidden_layers} layers,"
                    f" got {config.draft_layers}"
                )
            drafter = truncated_drafter(model, config.draft_layers)
        elif config.spec == "draft":
            draft_dir = resolve_model(config.draft_model).path
            drafter = LlamaForCausalLM.from_pretrained(draft_dir, dtype=dtype, device=device)
        elif config.spec == "mtp":
            if config.mtp_head:
                head_dir = Path(config.mtp_head)
            else:
                bundled = config.bundled_mtp_head
                assert bundled is not None  # TulipConfig refuses --spec mtp without a head
                head_dir = bundled.verified()
                log.info("tulip: --spec mtp with the bundled head %s", bundled.name)
            head = MTPHead.load(head_dir, dtype=dtype).to(device)
        tokenizer = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=True)

        context = cfg.max_position_embeddings
        spec = spec_config(config)
        k = spec.max_fed_drafts if config.spec != "none" else 0
        copies = 1 + kv_copies_of(config.spec)  # the target's cache and the proposer's
        pages = config.kv_pages or 2 * copies * math.ceil((context + k) / config.kv_page_size)
        eos_ids = _eos_ids(model_dir, cfg.eos_token_ids)
        engine = GenerationEngine(
            model,
            GenerationConfig(
                kv=KVCacheConfig(num_pages=pages, page_size=config.kv_page_size),
                max_batch=config.max_running_seqs,
                max_step_tokens=step_tokens(config, device),
                spec=spec,
                prefix_cache=config.prefix_cache,
            ),
            drafter=drafter,
            mtp_head=head,
            eos_ids=eos_ids,
            detokenize=decode,
            grammars=Grammars(model_dir, cfg.vocab_size, eos_ids),  # response_format
        )
        if config.prefix_cache and engine.prefix_cache_off_reason is not None:
            log.warning("tulip: prefix cache off: %s", engine.prefix_cache_off_reason)
        name = config.model_name or model_dir.name
        served = ServedModel(
            name=name,
            limits=ModelLimits(
                kind="generator",
                vocab_size=cfg.vocab_size,
                max_input_tokens=context,
                dimensions=0,
                default_normalize=False,
            ),
            info=pb.InfoResponse(
                model_name=name,
                kind=pb.MODEL_KIND_GENERATOR,
                max_input_tokens=context,
                vocab_size=cfg.vocab_size,
                device=str(engine.device),
                dtype=dtype_name,
            ),
        )
        return cls(engine, decode, served, config.max_queued_tokens)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, metrics: Metrics) -> None:
        """Start the engine thread (call from the server's event loop)."""
        self._metrics = metrics
        self._idle = asyncio.Event()
        self._idle.set()
        metrics.kv_pages.set(self._engine.allocator.num_pages)
        self._publish()
        self._thread = threading.Thread(target=self._run, name="tulip-generate", daemon=True)
        self._thread.start()

    async def warm_up(self) -> None:
        """Generate a couple of tokens so the first request pays no set-up."""
        vocab = self.served.limits.vocab_size
        work = GenerateWork(
            prompt_ids=[i % vocab for i in range(1, 9)],
            max_tokens=_WARMUP_TOKENS,
            temperature=0.0,
            top_p=1.0,
            top_k=0,
            seed=None,
            stop=(),
            stop_token_ids=(),
            ignore_eos=True,
        )
        stream = self.submit(work)
        try:
            async for _ in stream:
                pass
        finally:
            stream.close()

    def close_admission(self) -> None:
        """Refuse new requests (`Draining`); running streams continue."""
        self._closing = True

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests and wait up to `timeout` s until every stream has finished."""
        self.close_admission()
        if self._idle is None:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        """Stop the engine thread (sequences still running are aborted)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=_JOIN_SECONDS)

    # -- read-only state -----------------------------------------------------------------

    @property
    def num_sequences(self) -> int:
        """Requests the engine holds (running or waiting for pages)."""
        return len(self._live)

    @property
    def free_pages(self) -> int:
        return int(self._engine.allocator.num_free)

    @property
    def total_pages(self) -> int:
        return int(self._engine.allocator.num_pages)

    @property
    def sequence_capacity(self) -> int:
        """Most tokens (prompt + generated) one sequence can ever hold in the page pool,
        by the engine's worst-case admission rule (room for a draft, a second copy of the
        cache for a drafter model or MTP head)."""
        return self._engine.max_sequence_tokens

    # -- the event loop's side -----------------------------------------------------------

    def submit(self, work: GenerateWork) -> GenerationStream:
        """Queue `work` for the engine; raises `Draining` when shutting down."""
        from rose.sampling import SamplingParams

        if self._closing:
            raise Draining("server is shutting down; retry on another replica")
        tokens = len(work.prompt_ids)
        if self._queued_tokens + tokens > self._max_queued_tokens:
            raise Overloaded(
                f"queue full: {self._queued_tokens} prompt tokens wait for the engine, "
                f"limit {self._max_queued_tokens}; retry later"
            )
        if self._thread is None or self._idle is None:
            raise RuntimeError("GenerationBackend.start() was not called")
        max_tokens = work.max_tokens
        if not max_tokens:
            room = min(self.served.limits.max_input_tokens, self.sequence_capacity)
            max_tokens = room - len(work.prompt_ids)
            if max_tokens < 1:
                raise Overloaded(
                    f"prompt_ids: {len(work.prompt_ids)} tokens leave no room to generate in "
                    f"this server's KV cache ({self.sequence_capacity} tokens per sequence)"
                )
        try:
            params = SamplingParams(**work.sampling_kwargs(max_tokens))  # type: ignore[arg-type]
        except ValueError as error:
            raise InvalidInput(str(error)) from None
        loop = asyncio.get_running_loop()
        request = _Request(work, params, loop)
        self._queued_tokens += tokens
        self._open += 1
        self._idle.clear()
        grammars = getattr(self._engine, "grammars", None)
        if params.response_format is None or grammars is None:
            self._post("add", request)
        else:  # compiled in a worker first: the engine thread's compile is then a cache hit
            warm = loop.run_in_executor(None, _compile, grammars, params.response_format)

            def queue(done: asyncio.Future[None]) -> None:
                if not done.cancelled() and done.exception() is not None:
                    log.warning("tulip: compiling a response_format failed: %s", done.exception())
                self._post("add", request)  # the engine's own compile reports any failure

            warm.add_done_callback(queue)
        return GenerationStream(self, request)

    def _dequeued(self, request: _Request) -> None:
        if request.queued:
            request.queued = False
            self._queued_tokens -= len(request.work.prompt_ids)

    def _closed(self, request: _Request, abort: bool) -> None:
        self._dequeued(request)
        if abort:
            request.cancelled = True
            self._post("abort", request)
        self._open -= 1
        if self._open == 0 and self._idle is not None:
            self._idle.set()

    def _post(self, op: str, request: _Request) -> None:
        with self._cond:
            self._inbox.append((op, request))
            self._cond.notify()

    # -- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        engine = self._engine
        while True:
            with self._cond:
                while not self._inbox and not engine.has_unfinished() and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    break
                inbox, self._inbox = self._inbox, []
            for op, request in inbox:
                if op == "add":
                    self._add(request)
                else:
                    self._abort(request)
            if inbox:
                self._publish()
            if not engine.has_unfinished():
                continue
            started = time.monotonic()
            try:
                outputs = engine.step()
            except Exception as error:  # one failure must not kill the thread
                log.exception("tulip: generation step failed")
                self._fail_all(EngineFailed(f"generation engine failed: {error}"))
                continue
            for output in outputs:
                try:
                    self._deliver(output, started)
                except Exception as error:  # e.g. the detokenizer: fail this request only
                    log.exception("tulip: could not answer sequence %d", output.seq_id)
                    self._fail(output.seq_id, EngineFailed(f"generation failed: {error}"))
            self._record_step(time.monotonic() - started)
        for request in list(self._live.values()):
            self._abort(request)
        self._publish()

    def _add(self, request: _Request) -> None:
        from rose.generate import CapacityError

        if request.cancelled:
            return
        try:
            request.seq_id = self._engine.add(request.work.prompt_ids, request.params)
        except CapacityError as error:
            request.deliver(
                Overloaded(
                    f"prompt_ids + sampling.max_tokens need more KV cache than this server "
                    f"has ({error}); ask for fewer tokens"
                )
            )
            return
        except ValueError as error:
            request.deliver(InvalidInput(str(error)))
            return
        except Exception as error:
            log.exception("tulip: could not add a generation request")
            request.deliver(EngineFailed(f"generation engine failed: {error}"))
            return
        request.text = TextStream(self._decode, request.params.stop)
        self._live[request.seq_id] = request

    def _abort(self, request: _Request) -> None:
        if request.seq_id is not None and self._live.pop(request.seq_id, None) is not None:
            self._engine.abort(request.seq_id)

    def _deliver(self, output: StepOutput, started: float) -> None:
        if output.error is not None:  # this sequence alone failed; the engine dropped it
            self._fail(output.seq_id, EngineFailed(f"generation failed: {output.error}"))
            return
        request = self._live.get(output.seq_id)
        if request is None:
            return
        assert request.text is not None
        now = time.monotonic()
        if request.first_step is None:
            request.first_step = started
            if self._metrics is not None:
                self._metrics.time_to_first_token.observe(now - request.submitted)
        request.completion_tokens += len(output.new_ids)
        text = request.text.push(output.new_ids, output.finish_reason)
        response = pb.GenerateResponse(token_ids=output.new_ids, text=text)
        if output.logprobs is not None:  # one per token id, beside them
            response.logprobs.extend(map(_token_logprob, output.logprobs))
        if output.prompt_logprobs is not None:  # the first output's, once
            response.prompt_logprobs.extend(map(_token_logprob, output.prompt_logprobs))
        if output.finish_reason is not None:
            del self._live[output.seq_id]
            response.finish_reason = _FINISH.get(output.finish_reason, pb.FINISH_REASON_STOP)
            response.usage.prompt_tokens = len(request.work.prompt_ids)
            response.usage.completion_tokens = request.completion_tokens
            response.timing.queue_us = _us(request.first_step - request.submitted)
            response.timing.inference_us = _us(now - request.first_step)
        elif not output.new_ids:
            return  # nothing to say yet
        if self._metrics is not None:
            self._metrics.generated_tokens.inc(len(output.new_ids))
        request.deliver(response)

    def _fail(self, seq_id: int, error: TulipError) -> None:
        request = self._live.get(seq_id)
        if request is not None:
            self._abort(request)
            request.deliver(error)

    def _fail_all(self, error: TulipError) -> None:
        for request in list(self._live.values()):
            self._abort(request)
            request.deliver(error)
        self._publish()

    def _record_step(self, seconds: float) -> None:
        self._publish()
        metrics = self._metrics
        if metrics is None:
            return
        metrics.generate_step_seconds.observe(seconds)
        prefix = self._engine.prefix_cache
        if prefix is not None:
            totals = prefix.stats
            now_prefix = (totals.queried_tokens, totals.hit_tokens, totals.evicted_pages)
            queried, hit, evicted = (
                a - b for a, b in zip(now_prefix, self._prefix_seen, strict=True)
            )
            metrics.prefix_queried_tokens.inc(queried)
            metrics.prefix_hit_tokens.inc(hit)
            metrics.prefix_evicted_pages.inc(evicted)
            metrics.prefix_cached_pages.set(prefix.num_pages)
            self._prefix_seen = now_prefix
        stats = self._engine.stats
        now = _SpecTotals(stats.steps, stats.drafted, stats.accepted)
        if now == self._spec:
            return
        method = self.spec_method
        metrics.spec_steps.labels(method=method).inc(now.steps - self._spec.steps)
        metrics.spec_drafted.labels(method=method).inc(now.drafted - self._spec.drafted)
        metrics.spec_accepted.labels(method=method).inc(now.accepted - self._spec.accepted)
        metrics.spec_acceptance_rate.labels(method=method).set(stats.acceptance_rate)
        metrics.spec_mean_accepted_length.labels(method=method).set(stats.mean_accepted_length)
        self._spec = now

    def _publish(self) -> None:
        if self._metrics is not None:
            self._metrics.active_sequences.set(len(self._live))
            self._metrics.kv_pages_free.set(self._engine.allocator.num_free)


def _eos_ids(model_dir: Path, from_config: tuple[int, ...]) -> tuple[int, ...]:
    """config.json's EOS ids plus generation_config.json's (chat models often add one)."""
    ids = list(from_config)
    path = model_dir / "generation_config.json"
    if path.exists():
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        for token in eos if isinstance(eos, list) else [] if eos is None else [eos]:
            if int(token) not in ids:
                ids.append(int(token))
    return tuple(ids)


def _token_logprob(t: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(logprob=t.logprob, top_ids=t.top_ids, top_logprobs=t.top_logprobs)


def _us(seconds: float) -> int:
    return max(0, int(seconds * 1e6))
