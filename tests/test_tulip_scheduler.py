"""Scheduling logic of Tulip's batcher, against an in-test engine double.

The double implements the scheduler's `Backend` protocol: `step` records the batch and
returns a future the test completes, so every test controls exactly when the "engine"
finishes. Each result row is (sum of the row's ids, row length, row index in the batch),
so a request can check it got its own rows back. The real engine is exercised by
tests/test_tulip_server.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import numpy as np
import pytest

from tulip.errors import DeadlineExpired, Draining, EngineFailed, Overloaded
from tulip.inputs import Work
from tulip.metrics import Metrics
from tulip.scheduler import BatchInputs, BatchLimits, Result, Scheduler, ServiceTime


class StepDouble:
    """Records batches; each stays pending until the test calls `finish`."""

    def __init__(self) -> None:
        self.batches: list[BatchInputs] = []
        self.pending: list[asyncio.Future[np.ndarray]] = []
        self.fail_next_step = False
        self.auto_finish = False

    def step(self, batch: BatchInputs) -> Awaitable[np.ndarray]:
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("device lost")
        future: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        self.batches.append(batch)
        self.pending.append(future)
        if self.auto_finish:
            asyncio.get_running_loop().call_soon(self.finish, len(self.batches) - 1)
        return future

    def finish(self, index: int, error: Exception | None = None) -> None:
        batch, future = self.batches[index], self.pending[index]
        if error is not None:
            future.set_exception(error)
            return
        ends = np.cumsum(batch.lengths.astype(np.int64))
        sums = np.add.reduceat(batch.ids.astype(np.int64), ends - batch.lengths)
        rows = np.stack(
            [sums, batch.lengths.astype(np.int64), np.arange(batch.rows)], axis=1
        ).astype(np.float32)
        future.set_result(rows)


def work(*rows: list[int], pooling: str | None = None, normalize: bool | None = None) -> Work:
    return Work(
        ids=np.array([i for row in rows for i in row], dtype=np.uint32),
        lengths=np.array([len(row) for row in rows], dtype=np.uint32),
        pooling=pooling,
        normalize=normalize,
    )


def tokens_work(n: int, rows: int = 1, start: int = 1) -> Work:
    return work(*[list(range(start + r, start + r + n)) for r in range(rows)])


async def settle() -> None:
    """Let the scheduled pump and completion callbacks run."""
    for _ in range(10):
        await asyncio.sleep(0)


def run(
    test: Callable[[Scheduler, StepDouble, Metrics], Coroutine[Any, Any, None]],
    max_batch_tokens: int = 100,
    max_batch_rows: int = 100,
    max_queued_tokens: int = 1000,
    max_queue_seconds: float | None = None,
) -> Metrics:
    metrics = Metrics()
    double = StepDouble()

    async def main() -> None:
        scheduler = Scheduler(
            double,
            BatchLimits(
                max_batch_tokens=max_batch_tokens,
                max_batch_rows=max_batch_rows,
                max_queued_tokens=max_queued_tokens,
                max_queue_seconds=max_queue_seconds,
            ),
            metrics,
        )
        scheduler.start()
        await test(scheduler, double, metrics)
        double.auto_finish = True  # whatever the test left queued completes on drain
        for index, future in enumerate(double.pending):
            if not future.done():
                double.finish(index)
        assert await scheduler.drain(5.0)

    asyncio.run(asyncio.wait_for(main(), 30))
    return metrics


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def expected_rows(w: Work) -> list[tuple[float, float]]:
    ends = np.cumsum(w.lengths.astype(np.int64))
    sums = np.add.reduceat(w.ids.astype(np.int64), ends - w.lengths)
    return [(float(s), float(n)) for s, n in zip(sums, w.lengths, strict=True)]


def own_rows(result: Result) -> list[tuple[float, float]]:
    return [(float(r[0]), float(r[1])) for r in result.rows]


def test_each_request_gets_its_own_rows_back() -> None:
    works = [work([5, 6, 7], [9]), work([100]), work([1, 2], [3, 4], [50, 60, 70])]

    async def body(scheduler: Scheduler, double: StepDouble, _: Metrics) -> None:
        futures = [scheduler.submit(w) for w in works]
        await settle()
        assert len(double.batches) == 1  # all three fit the budget: one batch
        assert double.batches[0].lengths.tolist() == [3, 1, 1, 2, 2, 3]
        double.finish(0)
        for w, future in zip(works, futures, strict=True):
            result = await future
            assert own_rows(result) == expected_rows(w)
            assert result.queue_us >= 0 and result.inference_us >= 0

    metrics = run(body)
    assert sample(metrics, "tulip_batch_requests_count") == 1
    assert sample(metrics, "tulip_batch_requests_sum") == 3
    assert sample(metrics, "tulip_computed_rows_total") == 6


def test_batches_respect_token_budget_and_row_cap_in_fifo_order() -> None:
    async def body(scheduler: Scheduler, double: StepDouble, _: Metrics) -> None:
        sizes = [4, 4, 4, 3, 1, 3]
        futures = [scheduler.submit(tokens_work(n, start=10 * i)) for i, n in enumerate(sizes)]
        await settle()
        # budget 10 tokens: [4, 4] (adding 4 would make 12), then [4, 3, 1] prefetched.
        assert [b.lengths.tolist() for b in double.batches] == [[4, 4], [4, 3, 1]]
        double.finish(0)
        await settle()
        assert [b.lengths.tolist() for b in double.batches][2:] == [[3]]
        double.finish(1)
        double.finish(2)
        for i, future in enumerate(futures):
            assert own_rows(await future) == expected_rows(tokens_work(sizes[i], start=10 * i))

    run(body, max_batch_tokens=10)

    async def rows_body(scheduler: Scheduler, double: StepDouble, _: Metrics) -> None:
        for n in range(5):
            scheduler.submit(tokens_work(1, rows=2, start=n))
        await settle()
        assert [b.rows for b in double.batches] == [4, 4]  # row cap 5: two 2-row requests

    run(rows_body, max_batch_rows=5)


def test_request_larger_than_budget_runs_alone_and_stays_whole() -> None:
    async def body(scheduler: Scheduler, double: StepDouble, _: Metrics) -> None:
        small = scheduler.submit(tokens_work(2))
        big_work = tokens_work(30, rows=3)
        big = scheduler.submit(big_work)
        tail = scheduler.submit(tokens_work(2, start=7))
        await settle()
        assert [b.lengths.tolist() for b in double.batches] == [[2], [30, 30, 30]]
        double.finish(0)
        double.finish(1)
        await settle()
        assert double.batches[2].lengths.tolist() == [2]
        double.finish(2)
        assert own_rows(await big) == expected_rows(big_work)
        await small
        await tail

    run(body, max_batch_tokens=10, max_batch_rows=2)


def test_exactly_one_batch_is_prefetched_while_one_runs() -> None:
    async def body(scheduler: Scheduler, double: StepDouble, _: Metrics) -> None:
        futures = [scheduler.submit(tokens_work(5, start=i)) for i in range(6)]
        await settle()
        assert len(double.batches) == 2  # running + prefetched, though 4 more wait
        assert scheduler.queued_tokens == 20
        double.finish(0)
        await settle()
        assert len(double.batches) == 3
        # Work arriving while two batches are out waits for the next slot.
        late = scheduler.submit(tokens_work(5, start=99))
        await settle()
        assert len(double.batches) == 3
        for index in range(1, 7):
            await settle()
            double.finish(index)
        await asyncio.gather(*futures, late)

    run(body, max_batch_tokens=5)


def test_prefetched_batch_is_formed_while_the_engine_runs() -> None:
    async def body(scheduler: Scheduler, double: StepDouble, _: Metrics) -> None:
        first = scheduler.submit(tokens_work(3))
        await settle()
        assert len(double.batches) == 1
        second = scheduler.submit(tokens_work(3, start=5))
        await settle()
        assert len(double.batches) == 2  # formed before batch 0 finished
        assert not double.pending[0].done()
        double.finish(0)
        double.finish(1)
        await asyncio.gather(first, second)

    run(body)


def test_cancelled_request_never_reaches_the_engine() -> None:
    async def body(scheduler: Scheduler, double: StepDouble, metrics: Metrics) -> None:
        blocker = scheduler.submit(tokens_work(10))
        prefetched = scheduler.submit(tokens_work(10, start=3))
        await settle()
        assert len(double.batches) == 2
        doomed = scheduler.submit(tokens_work(7, start=40))
        kept = scheduler.submit(tokens_work(4, start=80))
        assert scheduler.queued_tokens == 11
        doomed.cancel()
        await settle()
        assert scheduler.queued_tokens == 4  # released at once, not at batch time
        assert sample(metrics, "tulip_queued_tokens") == 4
        double.finish(0)
        await settle()
        assert double.batches[2].lengths.tolist() == [4]
        assert all(40 not in b.ids.tolist() for b in double.batches)
        double.finish(1)
        double.finish(2)
        await asyncio.gather(blocker, prefetched, kept)

    metrics = run(body, max_batch_tokens=10)
    assert sample(metrics, "tulip_dropped_requests_total", reason="cancelled") == 1
    assert sample(metrics, "tulip_computed_tokens_total") == 24


def test_expired_deadline_is_dropped_before_the_engine() -> None:
    async def body(scheduler: Scheduler, double: StepDouble, _: Metrics) -> None:
        blocker = scheduler.submit(tokens_work(10))
        prefetched = scheduler.submit(tokens_work(10, start=3))
        await settle()
        expiring = scheduler.submit(tokens_work(3, start=40), deadline=time.monotonic() + 0.01)
        fine = scheduler.submit(tokens_work(3, start=80), deadline=time.monotonic() + 60)
        await asyncio.sleep(0.05)
        double.finish(0)
        await settle()
        with pytest.raises(DeadlineExpired):
            await expiring
        assert double.batches[2].lengths.tolist() == [3]
        assert 40 not in double.batches[2].ids.tolist()
        double.finish(1)
        double.finish(2)
        await asyncio.gather(blocker, prefetched, fine)

    metrics = run(body, max_batch_tokens=10)
    assert sample(metrics, "tulip_dropped_requests_total", reason="deadline") == 1


def test_admission_rejects_over_the_queued_token_limit_at_once() -> None:
    async def body(scheduler: Scheduler, double: StepDouble, _: Metrics) -> None:
        with pytest.raises(Overloaded, match="larger than the queue limit"):
            scheduler.submit(tokens_work(21))
        first = scheduler.submit(tokens_work(12))
        with pytest.raises(Overloaded, match="queue full"):
            scheduler.submit(tokens_work(9))
        await settle()  # the first request moved into a batch: room again
        assert scheduler.queued_tokens == 0
        second = scheduler.submit(tokens_work(9))
        double.finish(0)
        await settle()
        double.finish(1)
        await asyncio.gather(first, second)

    run(body, max_batch_tokens=100, max_queued_tokens=20)


def test_engine_failure_fails_only_that_batch_and_serving_continues() -> None:
    async def body(scheduler: Scheduler, double: StepDouble, _: Metrics) -> None:
        doomed = scheduler.submit(tokens_work(10))
        await settle()
        double.finish(0, RuntimeError("kernel fault"))
        with pytest.raises(EngineFailed, match="kernel fault"):
            await doomed
        double.fail_next_step = True
        refused = scheduler.submit(tokens_work(3))
        with pytest.raises(EngineFailed, match="device lost"):
            await refused
        ok_work = tokens_work(4, start=9)
        ok = scheduler.submit(ok_work)
        await settle()
        double.finish(1)
        assert own_rows(await ok) == expected_rows(ok_work)

    run(body, max_batch_tokens=10)


def test_per_request_pooling_and_normalize_expand_to_rows() -> None:
    async def body(scheduler: Scheduler, double: StepDouble, _: Metrics) -> None:
        a = scheduler.submit(work([1, 2], [3], pooling="cls", normalize=False))
        b = scheduler.submit(work([4]))
        await settle()
        batch = double.batches[0]
        assert batch.pooling == ["cls", "cls", None]
        assert batch.normalize == [False, False, None]
        assert batch.first_segment_lengths is None
        double.finish(0)
        await asyncio.gather(a, b)

    run(body)


def test_drain_finishes_queued_work_and_refuses_new_work() -> None:
    async def body(scheduler: Scheduler, double: StepDouble, _: Metrics) -> None:
        futures = [scheduler.submit(tokens_work(5, start=i)) for i in range(4)]
        await settle()
        draining = asyncio.ensure_future(scheduler.drain(10.0))
        await settle()
        with pytest.raises(Draining):
            scheduler.submit(tokens_work(1))
        for index in range(4):
            await settle()
            double.finish(index)
        assert await draining
        for i, future in enumerate(futures):
            assert own_rows(await future) == expected_rows(tokens_work(5, start=i))

    run(body, max_batch_tokens=5)


def test_drain_timeout_fails_what_is_left() -> None:
    async def body(scheduler: Scheduler, double: StepDouble, _: Metrics) -> None:
        futures = [scheduler.submit(tokens_work(5, start=i)) for i in range(3)]
        await settle()
        assert not await scheduler.drain(0.05)
        results = await asyncio.gather(*futures, return_exceptions=True)
        assert all(isinstance(r, Draining) for r in results)

    metrics = Metrics()
    double = StepDouble()

    async def main() -> None:
        scheduler = Scheduler(double, BatchLimits(5, 5, 100), metrics)
        scheduler.start()
        await body(scheduler, double, metrics)

    asyncio.run(main())


def test_a_request_the_engine_cannot_run_does_not_fail_its_batch_neighbours() -> None:
    poison = 666

    async def body(scheduler: Scheduler, double: StepDouble, _: Metrics) -> None:
        works = [tokens_work(3, start=1), work([5, poison, 7]), tokens_work(2, start=20)]
        futures = [scheduler.submit(w) for w in works]
        await settle()
        assert [b.lengths.tolist() for b in double.batches] == [[3, 3, 2]]
        double.finish(0, RuntimeError(f"bad token {poison}"))
        await settle()
        # Retried one request per batch, in the original order (two out at a time).
        assert [b.lengths.tolist() for b in double.batches[1:]] == [[3], [3]]
        double.finish(1)
        double.finish(2, RuntimeError(f"bad token {poison}"))
        await settle()
        assert double.batches[3].lengths.tolist() == [2]
        double.finish(3)
        assert own_rows(await futures[0]) == expected_rows(works[0])
        with pytest.raises(EngineFailed, match="bad token 666"):
            await futures[1]
        assert own_rows(await futures[2]) == expected_rows(works[2])
        assert scheduler.queued_tokens == 0

    metrics = run(body)
    assert sample(metrics, "tulip_isolated_requests_total") == 3


# -- admission by time --------------------------------------------------------------------


def test_service_time_fits_fixed_and_per_token_cost() -> None:
    fit = ServiceTime()
    assert not fit.known
    for tokens in (100, 1000, 400, 2000, 50):
        fit.observe(tokens, 0.01 + 1e-4 * tokens)
    fixed, per_token = fit.coefficients()
    assert fixed == pytest.approx(0.01, rel=1e-6)
    assert per_token == pytest.approx(1e-4, rel=1e-6)
    assert fit.seconds(3000, batches=2) == pytest.approx(0.02 + 0.3, rel=1e-6)


def test_service_time_of_one_batch_size_charges_everything_per_token() -> None:
    fit = ServiceTime()
    fit.observe(32, 0.032)
    fit.observe(32, 0.032)
    assert fit.coefficients() == (0.0, pytest.approx(1e-3))
    assert fit.seconds(1000) == pytest.approx(1.0)  # never under the measured rate


def test_admission_refuses_work_that_would_wait_longer_than_the_bound() -> None:
    async def body(scheduler: Scheduler, double: StepDouble, _: Metrics) -> None:
        scheduler.observe_batch(10, 1.0)  # 0.1 s per token, as measured
        # An idle engine takes a request whatever it costs ...
        running = scheduler.submit(tokens_work(10))
        await settle()
        assert scheduler.estimated_wait(time.monotonic()) == pytest.approx(1.0, abs=0.05)
        # ... but nothing that would wait ~1 s behind it, with a 0.5 s bound.
        with pytest.raises(Overloaded, match=r"about 1\.\d\ds of work ahead, limit 0\.50s"):
            scheduler.submit(tokens_work(1, start=50))
        double.finish(0)
        await settle()
        assert scheduler.estimated_wait(time.monotonic()) == 0.0
        after = scheduler.submit(tokens_work(1, start=50))  # room again
        await settle()
        double.finish(1)
        await asyncio.gather(running, after)

    run(body, max_queue_seconds=0.5)


def test_admission_refuses_what_cannot_finish_before_its_deadline() -> None:
    async def body(scheduler: Scheduler, double: StepDouble, _: Metrics) -> None:
        scheduler.observe_batch(10, 1.0)
        running = scheduler.submit(tokens_work(10))
        await settle()
        now = time.monotonic()
        with pytest.raises(Overloaded, match="before the request's deadline"):
            scheduler.submit(tokens_work(2, start=50), deadline=now + 1.1)  # needs ~1.2 s
        fits = scheduler.submit(tokens_work(2, start=60), deadline=now + 60)
        double.finish(0)
        await settle()
        double.finish(1)
        await asyncio.gather(running, fits)

    metrics = run(body)
    assert sample(metrics, "tulip_dropped_requests_total", reason="deadline") == 0


def test_admission_learns_the_engine_speed_from_finished_batches() -> None:
    async def body(scheduler: Scheduler, double: StepDouble, _: Metrics) -> None:
        first = scheduler.submit(tokens_work(10))
        await settle()
        await asyncio.sleep(0.2)  # the "engine" takes ~0.2 s for 10 tokens
        double.finish(0)
        await first
        blocker = scheduler.submit(tokens_work(10, start=5))
        await settle()
        wait = scheduler.estimated_wait(time.monotonic())
        assert 0.15 < wait < 0.3
        double.finish(1)
        await blocker

    run(body)
