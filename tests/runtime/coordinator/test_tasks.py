"""fail_on_error: a background task's exception reaches the job's failure, a cancel does not.
all_or_first_error: work at once, the first error raised as it is, the rest cancelled."""

from __future__ import annotations

import asyncio

import pytest

from polyrl_runtime.coordinator.tasks import all_or_first_error, fail_on_error


def test_an_exception_fails_with_its_name_and_a_cancel_or_a_return_does_not() -> None:
    failures: list[str] = []

    async def boom() -> None:
        raise KeyError("speaker")

    async def ok() -> None:
        return None

    async def main() -> None:
        tasks = [
            fail_on_error(asyncio.create_task(boom()), "accounting", failures.append),
            fail_on_error(asyncio.create_task(ok()), "quiet", failures.append),
            fail_on_error(asyncio.create_task(asyncio.sleep(10)), "cancelled", failures.append),
        ]
        tasks[2].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0)  # done callbacks run on the next loop turn

    asyncio.run(main())
    assert failures == ["accounting failed: KeyError: 'speaker'"]


async def test_all_or_first_error_runs_everything_at_once() -> None:
    started: list[str] = []
    both = asyncio.Event()

    async def side(name: str) -> None:
        started.append(name)
        if len(started) == 2:
            both.set()
        await asyncio.wait_for(both.wait(), 5)  # each waits for the other: only runs at once end

    await all_or_first_error(side("engines"), side("trainers"))
    assert sorted(started) == ["engines", "trainers"]


async def test_all_or_first_error_raises_the_error_itself_and_cancels_the_rest() -> None:
    cancelled = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def broken() -> None:
        await asyncio.sleep(0)
        raise ValueError("model load failed")

    with pytest.raises(ValueError, match="model load failed"):
        await all_or_first_error(slow(), broken())
    assert cancelled.is_set()  # cancelled and awaited before the error is raised
