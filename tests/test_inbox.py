"""A request's inbox merges what arrived while its stream was busy, never across a failure."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from engine.core.request import FinishReason
from engine.wire import TokenUpdate
from router.serving.inbox import Item, UpdateInbox

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def take_update(inbox: UpdateInbox, timeout_s: float, min_tokens: int = 1) -> TokenUpdate:
    """The inbox's next item, which must be an update (not a failure or a move)."""
    item = await inbox.take(timeout_s, min_tokens)
    assert isinstance(item, TokenUpdate), item
    return item


def test_updates_that_arrived_together_come_out_as_one() -> None:
    async def main() -> list[TokenUpdate]:
        inbox = UpdateInbox()
        inbox.put(TokenUpdate("r", kv_wire_s=0.002))
        for token in (5, 6, 7):
            inbox.put(TokenUpdate("r", (token,), num_cached_tokens=16))
        first = await take_update(inbox, 1.0)
        inbox.put(TokenUpdate("r", (8,), FinishReason.LENGTH))
        return [first, await take_update(inbox, 1.0)]

    first, last = run(main())
    assert first.new_token_ids == (5, 6, 7)
    assert first.kv_wire_s == 0.002 and first.num_cached_tokens == 16
    assert first.finish_reason is None
    assert last.new_token_ids == (8,) and last.finish_reason is FinishReason.LENGTH


def test_tokens_before_a_failure_come_first_then_the_failure() -> None:
    async def main() -> list[Item]:
        inbox = UpdateInbox()
        inbox.put(TokenUpdate("r", (1,)))
        inbox.put(TokenUpdate("r", (2,)))
        inbox.put(RuntimeError("worker lost"))
        inbox.put(TokenUpdate("r", (3,)))
        return [await inbox.take(1.0) for _ in range(3)]

    tokens, failure, after = run(main())
    assert isinstance(tokens, TokenUpdate) and tokens.new_token_ids == (1, 2)
    assert isinstance(failure, RuntimeError)
    assert isinstance(after, TokenUpdate) and after.new_token_ids == (3,)


def test_an_error_update_is_not_merged_into_tokens() -> None:
    async def main() -> list[TokenUpdate]:
        inbox = UpdateInbox()
        inbox.put(TokenUpdate("r", (1,)))
        inbox.put(TokenUpdate("r", finish_reason=FinishReason.ERROR, error="import failed"))
        return [await take_update(inbox, 1.0), await take_update(inbox, 1.0)]

    tokens, error = run(main())
    assert tokens.new_token_ids == (1,) and tokens.finish_reason is None
    assert error.finish_reason is FinishReason.ERROR and error.error == "import failed"


def test_nothing_is_merged_past_the_finish() -> None:
    async def main() -> list[TokenUpdate]:
        inbox = UpdateInbox()
        inbox.put(TokenUpdate("r", (1,), FinishReason.STOP))
        inbox.put(TokenUpdate("r", (2,)))
        return [await take_update(inbox, 1.0), await take_update(inbox, 1.0)]

    done, late = run(main())
    assert done.new_token_ids == (1,) and done.finish_reason is FinishReason.STOP
    assert late.new_token_ids == (2,)


def test_an_empty_inbox_times_out() -> None:
    with pytest.raises(TimeoutError):
        run(UpdateInbox().take(0.01))


def test_a_take_for_several_tokens_sleeps_through_smaller_puts() -> None:
    async def main() -> tuple[list[int], TokenUpdate]:
        inbox = UpdateInbox()
        num_put = [0]
        woken_at: list[int] = []

        async def reader() -> TokenUpdate:
            update = await take_update(inbox, 1.0, min_tokens=4)
            woken_at.append(num_put[0])
            return update

        task = asyncio.ensure_future(reader())
        for token in range(6):
            await asyncio.sleep(0)  # the reader runs between puts if woken
            inbox.put(TokenUpdate("r", (token,)))
            num_put[0] += 1
            await asyncio.sleep(0)
            if task.done():
                break
        return woken_at, await task

    woken_at, update = run(main())
    assert woken_at == [4]  # woken by the fourth token, not before
    assert update.new_token_ids == (0, 1, 2, 3)


def test_a_finish_or_failure_wakes_a_take_for_several_tokens_at_once() -> None:
    async def main() -> list[Item]:
        inbox = UpdateInbox()
        got: list[Item] = []

        async def reader() -> None:
            got.append(await inbox.take(1.0, min_tokens=8))
            got.append(await inbox.take(1.0, min_tokens=8))

        task = asyncio.ensure_future(reader())
        await asyncio.sleep(0)
        inbox.put(TokenUpdate("r", (1,)))
        inbox.put(TokenUpdate("r", (2,), FinishReason.STOP))
        await asyncio.sleep(0)
        inbox.put(RuntimeError("worker lost"))
        await asyncio.wait_for(task, 1.0)
        return got

    done, failure = run(main())
    assert isinstance(done, TokenUpdate)
    assert done.new_token_ids == (1, 2) and done.finish_reason is FinishReason.STOP
    assert isinstance(failure, RuntimeError)


def test_a_take_for_several_tokens_returns_what_came_when_the_wait_runs_out() -> None:
    async def main() -> TokenUpdate:
        inbox = UpdateInbox()
        inbox.put(TokenUpdate("r", (1,)))
        return await take_update(inbox, 0.02, min_tokens=8)

    assert run(main()).new_token_ids == (1,)
