"""The router's call connection to a worker (engine/worker/calls.py): replies matched to their
calls, calls run side by side, the worker's errors raised at the caller, strangers
refused, and a lost worker failing every call in flight instead of leaving it hanging."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from engine.worker.calls import CallClient, CallServer, CallsLost, listen_host
from engine.worker.contract import WORKER_VERBS
from router.fleet.clients import DirectWorkerClient, RayWorkerClient, WorkerDied

TOKEN = b"t" * 32


class Target:
    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.seen: list[str] = []

    async def load(self) -> str:
        self.seen.append("load")
        return "stats"

    async def next_tokens(self) -> str:  # a long poll
        self.seen.append("next_tokens")
        await self.release.wait()
        return "tokens"

    async def abort(self, req_id: str) -> None:
        self.seen.append(f"abort {req_id}")
        raise KeyError(req_id)

    async def detach(self, req_ids: list[str]) -> object:  # a reply that cannot be pickled
        return lambda: req_ids

    def secret(self) -> str:  # not a verb: never callable from outside
        return "no"


async def serve(target: Target) -> tuple[CallServer, str]:
    server = CallServer(target, TOKEN, WORKER_VERBS)
    return server, await server.start("127.0.0.1")


@contextlib.asynccontextmanager
async def connected() -> AsyncIterator[tuple[Target, CallClient]]:
    """A worker's call server over a fresh target, and a client with the right token."""
    target = Target()
    server, address = await serve(target)
    client = CallClient(address, TOKEN)
    try:
        yield target, client
    finally:
        client.close()
        await server.close()


def test_the_clients_carry_the_contracts_verbs_and_no_other() -> None:
    """Both clients are made from the contract (engine/worker/contract.py): every verb
    there is a method, and nothing else is."""
    for client in (DirectWorkerClient("127.0.0.1:1", TOKEN), RayWorkerClient(None)):
        for verb in WORKER_VERBS:
            assert callable(getattr(client, verb)), verb
        with pytest.raises(AttributeError, match="secret"):
            client.secret  # noqa: B018 - the lookup is what is tested
        assert not hasattr(client, "start")  # a worker method, not a router's call


def test_a_verb_goes_out_with_its_name_and_arguments() -> None:
    sent: list[tuple[str, tuple[object, ...]]] = []

    class Recording(DirectWorkerClient):
        async def _invoke(self, verb: str, *args: object) -> object:
            sent.append((verb, args))
            return len(sent)

    async def main() -> None:
        client = Recording("127.0.0.1:1", TOKEN)
        assert await client.renew(["a", "b"], 5.0) == 1
        assert await client.disconnect("decode-1", False) == 2

    asyncio.run(main())
    assert sent == [("renew", (["a", "b"], 5.0)), ("disconnect", ("decode-1", False))]


def test_a_long_poll_does_not_hold_up_the_calls_behind_it() -> None:
    async def main() -> None:
        async with connected() as (target, client):
            poll = asyncio.ensure_future(client.call("next_tokens"))
            assert await asyncio.wait_for(client.call("load"), 5) == "stats"
            assert not poll.done()
            target.release.set()
            assert await asyncio.wait_for(poll, 5) == "tokens"
            assert target.seen == ["next_tokens", "load"]  # started in the order sent

    asyncio.run(main())


def test_the_workers_error_is_raised_at_the_caller_and_unknown_verbs_are_refused() -> None:
    async def main() -> None:
        async with connected() as (_, client):
            with pytest.raises(KeyError, match="r1"):
                await asyncio.wait_for(client.call("abort", "r1"), 5)
            with pytest.raises(AttributeError, match="secret"):
                await asyncio.wait_for(client.call("secret"), 5)
            with pytest.raises(RuntimeError, match="detach"):
                await asyncio.wait_for(client.call("detach", ["r1"]), 5)
            assert await asyncio.wait_for(client.call("load"), 5) == "stats"  # still usable

    asyncio.run(main())


def test_a_connection_without_the_token_is_closed_unanswered() -> None:
    async def main() -> None:
        target = Target()
        server, address = await serve(target)
        client = CallClient(address, b"x" * 32)
        with pytest.raises(CallsLost):
            await asyncio.wait_for(client.call("load"), 5)
        assert target.seen == []
        await server.close()

    asyncio.run(main())


def test_a_lost_worker_fails_the_calls_in_flight_and_later_ones_as_worker_died() -> None:
    async def main() -> None:
        target = Target()
        server, address = await serve(target)
        client = DirectWorkerClient(address, TOKEN)
        poll = asyncio.ensure_future(client.next_tokens())
        await asyncio.sleep(0.2)
        await server.close()  # as when the worker's process ends
        with pytest.raises(WorkerDied):
            await asyncio.wait_for(poll, 5)
        with pytest.raises(WorkerDied):
            await asyncio.wait_for(client.load(), 5)

    asyncio.run(main())


def test_no_worker_listening_is_worker_died() -> None:
    async def main() -> None:
        server, address = await serve(Target())
        await server.close()
        client = DirectWorkerClient(address, TOKEN)
        with pytest.raises(WorkerDied):
            await asyncio.wait_for(client.load(), 5)

    asyncio.run(main())


def test_a_worker_listens_on_loopback_on_the_routers_node_only() -> None:
    assert listen_host("10.0.0.5", "10.0.0.5") == "127.0.0.1"
    assert listen_host("10.0.0.6", "10.0.0.5") == "10.0.0.6"
