"""First-come-first-served batching by token budget, with one batch prefetched.

Everything runs on the event loop's thread. Request handlers only call
`Scheduler.submit` (which admits or rejects at once) and await the returned future. The
scheduler:

* fills a batch from the head of the queue up to ``max_batch_tokens`` and
  ``max_batch_rows``, never splitting a request; a request bigger than the budget runs on
  its own;
* admits by time, not only by tokens: from the batches it has run it estimates how long
  the work ahead of a new request takes (`ServiceTime`), and refuses at once
  (`Overloaded`, RESOURCE_EXHAUSTED) a request that would wait longer than
  ``max_queue_seconds`` or could not finish before its deadline, so admitted work is
  answered in time and overload turns into quick refusals a gateway can retry elsewhere;
* drops requests whose future was cancelled (the client went away) or whose deadline has
  passed, before they reach the engine;
* keeps at most two batches with the engine: batch N running and batch N+1 already formed
  and submitted, so the engine never waits for Python between batches;
* answers each request with exactly its own rows of the batch result;
* when the engine fails on a batch of several requests, retries each in a batch of its
  own, so the failure reaches only the request that caused it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tulip.errors import DeadlineExpired, Draining, EngineFailed, Overloaded
from tulip.inputs import Work
from tulip.metrics import Metrics

__all__ = [
    "Backend",
    "BatchInputs",
    "BatchLimits",
    "BatchOutputs",
    "Ragged",
    "Result",
    "Scheduler",
]

log = logging.getLogger("tulip.scheduler")

_PIPELINE_DEPTH = 2  # the running batch plus exactly one prefetched batch


@dataclass(frozen=True, eq=False)
class BatchInputs:
    """One engine batch: the packed inputs of every request in it, in queue order."""

    ids: np.ndarray
    lengths: np.ndarray
    first_segment_lengths: np.ndarray | None
    pooling: list[str | None] | None
    normalize: list[bool | None] | None
    span_counts: np.ndarray | None = None
    """[rows] spans per input when any request has spans (others count one whole-input span)."""
    spans: np.ndarray | None = None
    """[spans, 2] [start, end) of each span within its input."""
    kinds: list[frozenset[str]] | None = None
    """[rows] extra output kinds per input when any request asks for some (others: none)."""

    @property
    def rows(self) -> int:
        return int(self.lengths.size)

    @property
    def outputs(self) -> int:
        """Result rows of the batch: one per span, or one per input."""
        return self.rows if self.span_counts is None else int(self.span_counts.sum())

    @property
    def tokens(self) -> int:
        return int(self.ids.size)


@dataclass(frozen=True, eq=False)
class Ragged:
    """Variable-length results per input: input i owns the next ``counts[i]`` entries of
    ``values`` (and of ``indices``, token ids of sparse weights)."""

    counts: np.ndarray
    values: np.ndarray
    indices: np.ndarray | None = None

    def inputs(self, start: int, stop: int) -> Ragged:
        """Inputs start..stop-1 of the batch (the scheduler's split per request)."""
        first = int(self.counts[:start].sum())
        last = first + int(self.counts[start:stop].sum())
        return Ragged(
            self.counts[start:stop],
            self.values[first:last],
            None if self.indices is None else self.indices[first:last],
        )


@dataclass(frozen=True, eq=False)
class BatchOutputs:
    """A batch's result when some request asked for more than dense rows: the rows and,
    per extra output kind, every input's entries (0 for inputs that did not ask)."""

    rows: np.ndarray
    extras: dict[str, Ragged]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.rows.shape)


class Backend(Protocol):
    """What the scheduler needs from an engine."""

    def step(self, batch: BatchInputs) -> Awaitable[np.ndarray | BatchOutputs]:
        """Start computing `batch` now; the awaitable yields one result row per input (one
        per span with spans), as `BatchOutputs` when the batch has `kinds`."""
        ...


@dataclass(frozen=True)
class BatchLimits:
    max_batch_tokens: int
    max_batch_rows: int
    max_queued_tokens: int
    max_queue_seconds: float | None = None
    """Refuse work that would wait longer than this for the engine; None: no time bound."""


class ServiceTime:
    """How long the engine takes for a batch of n tokens: ``fixed + per_token * n``,
    fitted by least squares over the recent batches (exponentially forgotten).

    With batches of one size only, the fit has no slope to find; then the whole time is
    charged per token (an over-estimate for small batches, never an under-estimate).
    """

    _DECAY = 0.9  # weight kept by the history at each new batch (~10 batches' memory)

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    @property
    def known(self) -> bool:
        return self._w > 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self._DECAY
        x, y = float(tokens), max(0.0, seconds)
        self._w = d * self._w + 1.0
        self._x = d * self._x + x
        self._y = d * self._y + y
        self._xx = d * self._xx + x * x
        self._xy = d * self._xy + x * y

    def coefficients(self) -> tuple[float, float]:
        """(fixed seconds per batch, seconds per token)."""
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        if var > 1e-9 * max(1.0, mean_x * mean_x):
            per_token = (self._xy / self._w - mean_x * mean_y) / var
            fixed = mean_y - per_token * mean_x
            if per_token > 0.0 and fixed >= 0.0:
                return fixed, per_token
        return 0.0, mean_y / max(mean_x, 1.0)

    def seconds(self, tokens: int, batches: int = 1) -> float:
        fixed, per_token = self.coefficients()
        return batches * fixed + tokens * per_token


@dataclass(frozen=True, eq=False)
class Result:
    """A request's rows of its batch result and where its time went."""

    rows: np.ndarray
    queue_us: int
    inference_us: int
    extras: dict[str, Ragged] = dataclasses.field(default_factory=dict)
    """The request's entries of each extra output kind it asked for."""


@dataclass(eq=False)
class _Job:
    work: Work
    future: asyncio.Future[Result]
    admitted: float
    deadline: float | None
    queued: bool = True
    alone: bool = False
    """Retry of a failed shared batch: runs in a batch of its own."""


@dataclass(eq=False)
class _Flight:
    jobs: list[_Job]
    rows: int
    tokens: int
    submitted: float
    outputs: int
    """Result rows expected: one per input, or one per span."""
    task: asyncio.Future[np.ndarray | BatchOutputs]
    started: float | None = None
    """When the engine began this batch: its submission, or the previous batch's end."""


class Scheduler:
    """Owns the request queue and the engine's batch pipeline (one per server).

    Event-driven, on the event loop's thread: `submit` schedules one pump for the
    current loop iteration (so requests arriving together share a batch), and each
    batch's completion callback answers its requests and launches the next batch at
    once. No task sits between a request and the engine.
    """

    def __init__(self, backend: Backend, limits: BatchLimits, metrics: Metrics) -> None:
        self._backend = backend
        self._limits = limits
        self._metrics = metrics
        self._queue: collections.deque[_Job] = collections.deque()
        self._queued_tokens = 0
        self._queued_requests = 0
        self._flights: collections.deque[_Flight] = collections.deque()
        self._idle = asyncio.Event()
        self._service = ServiceTime()
        self._started = False
        self._pump_scheduled = False
        self._closing = False
        self._stopped = False

    # -- handlers' side ------------------------------------------------------------------

    def submit(
        self, work: Work, deadline: float | None = None, *, admitted: bool = False
    ) -> asyncio.Future[Result]:
        """Admit `work` or raise `Overloaded` / `Draining` at once.

        `deadline` is a `time.monotonic()` instant after which the work is dropped if it
        has not reached the engine yet; work that could not finish by then is refused.
        `admitted` marks a later part of a request whose earlier part was taken: the
        queue-time limit, which exists to refuse new work, does not apply to it.
        Cancelling the returned future drops the work.
        """
        if self._closing:
            raise Draining("server is shutting down; retry on another replica")
        limit = self._limits.max_queued_tokens
        if work.tokens > limit:
            raise Overloaded(
                f"request of {work.tokens} tokens is larger than the queue limit "
                f"({limit} tokens); split it"
            )
        if self._queued_tokens + work.tokens > limit:
            raise Overloaded(
                f"queue full: {self._queued_tokens} tokens queued, limit {limit}; retry later"
            )
        now = time.monotonic()
        if self._service.known:
            wait = self.estimated_wait(now)
            bound = self._limits.max_queue_seconds
            busy = bool(self._queued_requests or self._flights)
            if bound is not None and not admitted and wait > bound and busy:
                raise Overloaded(
                    f"queue full: about {wait:.2f}s of work ahead, limit {bound:.2f}s; retry later"
                )
            if deadline is not None and wait > 0.0:
                left = deadline - now
                if wait + self._service.seconds(work.tokens) > left:
                    raise Overloaded(
                        f"cannot finish before the request's deadline: about {wait:.2f}s of "
                        f"work ahead, {max(0.0, left):.2f}s left; retry later"
                    )
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        job = _Job(work=work, future=future, admitted=now, deadline=deadline)
        future.add_done_callback(functools.partial(self._on_done, job))
        self._queue.append(job)
        self._queued_tokens += work.tokens
        self._queued_requests += 1
        self._publish_queue()
        self._schedule_pump()
        return future

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    def estimated_wait(self, now: float) -> float:
        """Seconds until the engine could start a request submitted `now`: what is left of
        the running batch, the prefetched one, and the queue (in full batches)."""
        if not self._service.known:
            return 0.0
        wait = 0.0
        for i, flight in enumerate(self._flights):
            seconds = self._service.seconds(flight.tokens)
            if i == 0 and flight.started is not None:
                # A batch running past its estimate is not about to end: count a tenth of
                # the estimate as left (the estimate is what was wrong).
                seconds = max(seconds - (now - flight.started), 0.1 * seconds)
            wait += max(0.0, seconds)
        queued = self._queued_tokens
        if queued:
            batches = -(-queued // self._limits.max_batch_tokens)
            wait += self._service.seconds(queued, batches)
        return wait

    def seconds_per_token(self) -> float:
        """The engine's measured cost of one more token in a batch (0.0: not measured)."""
        return self._service.coefficients()[1] if self._service.known else 0.0

    def observe_batch(self, tokens: int, seconds: float) -> None:
        """Teach the admission estimate a batch's time (the warm-up's, before serving)."""
        self._service.observe(tokens, seconds)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Begin handing batches to the engine (work submitted before waits until now)."""
        self._started = True
        self._schedule_pump()

    def close(self) -> None:
        """Admit nothing more; queued and in-flight work still completes."""
        self._closing = True
        self._check_idle()

    async def drain(self, timeout: float) -> bool:
        """Close, then wait up to `timeout` seconds for all admitted work to be answered.

        Returns whether everything was answered; on timeout the work still queued or in
        flight is failed with `Draining` and the pipeline stops.
        """
        self.close()
        if not self._started:
            self._fail_queued(Draining("server shut down before the request was computed"))
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:  # not the builtin before Python 3.11
            self._stop()
            return False
        return True

    # -- the pipeline --------------------------------------------------------------------

    def _schedule_pump(self) -> None:
        if self._started and not self._stopped and not self._pump_scheduled:
            self._pump_scheduled = True
            asyncio.get_running_loop().call_soon(self._pump)

    def _pump(self) -> None:
        """Fill the pipeline: the running batch plus one prefetched batch."""
        self._pump_scheduled = False
        if self._stopped:
            return
        try:
            while len(self._flights) < _PIPELINE_DEPTH and self._queued_requests:
                flight = self._launch(previous=self._flights[-1] if self._flights else None)
                if flight is not None:
                    self._flights.append(flight)
                    flight.task.add_done_callback(self._landed)
            self._check_idle()
        except Exception:
            self._crash()

    def _landed(self, _task: asyncio.Future[np.ndarray | BatchOutputs]) -> None:
        """A batch finished: answer the batches done at the pipeline's head, in order,
        then launch what is queued."""
        if self._stopped:
            return
        try:
            while self._flights and self._flights[0].task.done():
                flight = self._flights.popleft()
                self._finish(flight, next_flight=self._flights[0] if self._flights else None)
        except Exception:
            self._crash()
            return
        self._pump()

    def _check_idle(self) -> None:
        if self._closing and not self._flights and not self._queued_requests:
            self._idle.set()

    def _stop(self) -> None:
        """Fail everything still queued or in flight with `Draining`; launch nothing more."""
        self._stopped = True
        self._fail_queued(Draining("server shut down before the request was computed"))
        flights, self._flights = list(self._flights), collections.deque()
        for flight in flights:
            flight.task.cancel()
            for job in flight.jobs:
                if not job.future.done():
                    job.future.set_exception(Draining("server shut down before the batch finished"))
        self._idle.set()

    def _crash(self) -> None:
        log.exception("tulip: the batcher failed; refusing new work")
        self._closing = True
        self._stop()

    def _launch(self, previous: _Flight | None) -> _Flight | None:
        """Form the next batch from the queue head and hand it to the engine."""
        jobs: list[_Job] = []
        tokens = rows = 0
        now = time.monotonic()
        while self._queue:
            job = self._queue[0]
            if not job.queued:  # cancelled while waiting; already accounted for
                self._queue.popleft()
                continue
            if job.deadline is not None and now >= job.deadline:
                self._queue.popleft()
                self._dequeue(job)
                self._metrics.dropped.labels(reason="deadline").inc()
                job.future.set_exception(DeadlineExpired("deadline passed while queued"))
                continue
            work = job.work
            if jobs and (
                job.alone
                or tokens + work.tokens > self._limits.max_batch_tokens
                or rows + work.rows > self._limits.max_batch_rows
            ):
                break
            self._queue.popleft()
            self._dequeue(job)
            jobs.append(job)
            tokens += work.tokens
            rows += work.rows
            if job.alone:
                break
        self._publish_queue()
        if not jobs:
            return None
        batch = _assemble(jobs)
        submitted = time.monotonic()
        try:
            task = asyncio.ensure_future(self._backend.step(batch))
        except Exception as error:  # the engine refused the batch
            self._fail_or_isolate(jobs, EngineFailed(f"engine rejected the batch: {error}"))
            return None
        self._metrics.batch_rows.observe(rows)
        self._metrics.batch_tokens.observe(tokens)
        self._metrics.batch_requests.observe(len(jobs))
        self._metrics.computed_rows.inc(rows)
        self._metrics.computed_tokens.inc(tokens)
        # The engine runs batches in order: a prefetched batch starts when the previous ends.
        return _Flight(
            jobs=jobs,
            rows=rows,
            tokens=tokens,
            submitted=submitted,
            outputs=sum(job.work.outputs for job in jobs),
            task=task,
            started=submitted if previous is None else None,
        )

    def _finish(self, flight: _Flight, next_flight: _Flight | None) -> None:
        ended = time.monotonic()
        if next_flight is not None and next_flight.started is None:
            next_flight.started = max(next_flight.submitted, ended)
        started = flight.started if flight.started is not None else flight.submitted
        self._metrics.inference_seconds.observe(ended - started)
        error = flight.task.exception() if not flight.task.cancelled() else None
        if not flight.task.cancelled() and error is None:
            self._service.observe(flight.tokens, ended - started)
        if flight.task.cancelled() or error is not None:
            failure = EngineFailed(f"engine failed on a batch of {flight.rows} inputs: {error}")
            self._fail_or_isolate(flight.jobs, failure)
            return
        result = flight.task.result()
        extras: dict[str, Ragged] = {}
        output = result
        if isinstance(result, BatchOutputs):
            output, extras = result.rows, result.extras
        if output.shape[0] != flight.outputs:
            failure = EngineFailed(f"engine returned {output.shape[0]} rows for {flight.outputs}")
            for job in flight.jobs:
                if not job.future.done():
                    job.future.set_exception(failure)
            return
        inference_us = int((ended - started) * 1e6)
        offset = first_input = 0
        for job in flight.jobs:
            rows = job.work.outputs
            queue_s = started - job.admitted
            self._metrics.queue_seconds.observe(queue_s)
            if not job.future.done():  # a client that left after submission gets nothing
                stop = first_input + job.work.rows
                wanted = job.work.kinds or frozenset()
                if wanted - extras.keys():
                    lost = ", ".join(sorted(wanted - extras.keys()))
                    job.future.set_exception(EngineFailed(f"engine returned no {lost} output"))
                else:
                    job.future.set_result(
                        Result(
                            rows=output[offset : offset + rows],
                            queue_us=int(queue_s * 1e6),
                            inference_us=inference_us,
                            extras={k: extras[k].inputs(first_input, stop) for k in wanted},
                        )
                    )
            offset += rows
            first_input += job.work.rows

    def _fail_or_isolate(self, jobs: list[_Job], failure: EngineFailed) -> None:
        """A failed batch of one request fails it; a shared one is retried request by
        request, so one request the engine cannot run does not fail its neighbours."""
        live = [job for job in jobs if not job.future.done()]
        if len(jobs) == 1 or not live:
            for job in live:
                job.future.set_exception(failure)
            return
        log.warning("tulip: %s; retrying its %d requests one by one", failure, len(live))
        for job in reversed(live):
            job.alone = True
            job.queued = True
            self._queue.appendleft(job)
            self._queued_tokens += job.work.tokens
            self._queued_requests += 1
        self._metrics.isolated.inc(len(live))
        self._publish_queue()

    # -- bookkeeping ---------------------------------------------------------------------

    def _on_done(self, job: _Job, _future: asyncio.Future[Result]) -> None:
        if job.queued and job.future.cancelled():
            self._dequeue(job)
            self._metrics.dropped.labels(reason="cancelled").inc()
            self._publish_queue()

    def _dequeue(self, job: _Job) -> None:
        if job.queued:
            job.queued = False
            self._queued_tokens -= job.work.tokens
            self._queued_requests -= 1

    def _fail_queued(self, error: Exception) -> None:
        while self._queue:
            job = self._queue.popleft()
            if job.queued:
                self._dequeue(job)
                if not job.future.done():
                    job.future.set_exception(error)
        self._publish_queue()

    def _publish_queue(self) -> None:
        self._metrics.queue_depth.set(self._queued_requests)
        self._metrics.queued_tokens.set(self._queued_tokens)


def _assemble(jobs: list[_Job]) -> BatchInputs:
    works = [job.work for job in jobs]
    if len(works) == 1:
        only = works[0]
        ids, lengths = only.ids, only.lengths
    else:
        ids = np.concatenate([w.ids for w in works])
        lengths = np.concatenate([w.lengths for w in works])
    first = None
    if any(w.first_segment_lengths is not None for w in works):
        first = np.concatenate(
            [
                w.first_segment_lengths
                if w.first_segment_lengths is not None
                else np.asarray(w.lengths, dtype=np.uint32)
                for w in works
            ]
        )
    pooling: list[str | None] | None = None
    normalize: list[bool | None] | None = None
    if any(w.pooling is not None or w.normalize is not None for w in works):
        pooling = [w.pooling for w in works for _ in range(w.rows)]
        normalize = [w.normalize for w in works for _ in range(w.rows)]
    span_counts = spans = None
    if any(w.span_counts is not None for w in works):
        span_counts = np.concatenate(
            [
                w.span_counts if w.span_counts is not None else np.ones(w.rows, dtype=np.uint32)
                for w in works
            ]
        )
        spans = np.concatenate(
            [
                w.spans
                if w.spans is not None
                else np.stack([np.zeros(w.rows, dtype=np.uint32), w.lengths], axis=1)
                for w in works
            ]
        )
    kinds: list[frozenset[str]] | None = None
    if any(w.kinds for w in works):
        # Requests asking for different kinds share the batch: the engine computes each
        # kind for the rows that ask only, and `_finish` hands each request its own.
        none: frozenset[str] = frozenset()
        kinds = [w.kinds or none for w in works for _ in range(w.rows)]
    return BatchInputs(
        ids=ids,
        lengths=lengths,
        first_segment_lengths=first,
        pooling=pooling,
        normalize=normalize,
        span_counts=span_counts,
        spans=spans,
        kinds=kinds,
    )
