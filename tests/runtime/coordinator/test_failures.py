"""fail_on_error: a background task's exception reaches the job's failure, a cancel does not."""

from __future__ import annotations

import asyncio

from polyrl_runtime.coordinator.failures import fail_on_error


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
