"""What the gRPC edge costs one request at concurrency 1, against a bare grpc.aio server.

The router's gRPC server (`router.edge.grpc_server.GrpcServer`: interceptors, servicer,
metrics) over a core that gives its first token `--work-ms` after the call reaches it,
side by side with a bare `grpc.aio` server whose handler waits the same time, both in
processes of their own on loopback, alternating rounds. The wait ends from another
thread, as a worker's reply lands in an idle event loop; requests go one at a time,
`--gap-ms` apart, as a lone user's do. Each first message carries the server's clock
readings, so the client splits its time to first token (less the work) into the way
in (its send to the handler's start) and the way out (the first token in the server's
hands to the client's receipt). What is left over the bare server is the router's own
edge; the bare server's is gRPC's and the client's, which every service in Python pays
and an in-process engine does not.

    python -m bench.grpc_edge --out grpc_edge.json
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from bench.report import percentile, write_result

SERVERS = ("bare", "router")


async def _after(seconds: float) -> None:
    """Wait as a worker's reply arrives: a thread wakes the idle event loop."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    threading.Timer(seconds, loop.call_soon_threadsafe, (done.set_result, None)).start()
    await done


def _stamp(start_ns: int) -> str:
    """The handler's start and its first token's time, as the first message's text."""
    return f"{start_ns} {time.time_ns()}"


def _bare_server(work_s: float) -> Any:
    import grpc

    from pdserve.v1 import generation_pb2 as pb
    from pdserve.v1 import generation_pb2_grpc as pb_grpc

    class Servicer(pb_grpc.GenerationServiceServicer):
        async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
            start = time.time_ns()
            await _after(work_s)
            yield pb.GenerateResponse(text=_stamp(start), token_ids=[1])
            yield pb.GenerateResponse(token_ids=[2], finish_reason=pb.FINISH_REASON_LENGTH)

    server = grpc.aio.server()
    pb_grpc.add_GenerationServiceServicer_to_server(Servicer(), server)
    return server


class _TimedCore:
    """The router's Generator: a first token `work_s` after the call, then the end."""

    def __init__(self, work_s: float) -> None:
        self.work_s = work_s

    async def generate(self, call: Any) -> AsyncIterator[Any]:
        from engine.core.outputs import FinalResult, TextChunk, Usage
        from engine.core.request import FinishReason

        start = time.time_ns()
        await _after(self.work_s)
        yield TextChunk(text=_stamp(start), token_ids=(1,))
        yield TextChunk(text="", token_ids=(2,))
        yield FinalResult(FinishReason.LENGTH, Usage(len(call.prompt_token_ids or ()), 2))

    def server_info(self) -> Any:
        from router.serving.protocol import ServerInfo

        return ServerInfo("edge", 4096, 16, 0, 0, 1, 1, num_colocated_workers=1)

    async def pool_stats(self) -> Any:
        from router.serving.protocol import PoolStats

        return PoolStats(workers=(), num_in_flight=0, num_queued=0)

    def is_ready(self) -> bool:
        return True


def _serve(kind: str, work_s: float, ports: Any) -> None:
    """A server process: start, report the port, serve until terminated."""

    async def main() -> None:
        if kind == "bare":
            server = _bare_server(work_s)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
        else:
            from router.edge.grpc_server import GrpcServer
            from router.observability.metrics import RouterMetrics

            edge = GrpcServer(_TimedCore(work_s), port=0, metrics=RouterMetrics())
            port = await edge.start()
            await edge.set_serving()
        ports.put(port)
        await asyncio.Event().wait()

    asyncio.run(main())


async def _drive(
    port: int, requests: int, prompt_tokens: int, gap_s: float
) -> list[dict[str, float]]:
    import grpc

    from pdserve.v1 import generation_pb2 as pb
    from pdserve.v1 import generation_pb2_grpc as pb_grpc

    request = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True))
    request.prompt_token_ids.token_ids.extend(range(prompt_tokens))
    out = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        await asyncio.wait_for(channel.channel_ready(), timeout=30)
        for _ in range(requests):
            sent = time.time_ns()
            first: tuple[int, str] | None = None
            async for response in stub.Generate(request, timeout=30):
                if first is None:
                    first = (time.time_ns(), response.text)
            assert first is not None
            received, text = first
            start, token = (int(x) for x in text.split())
            out.append(
                {
                    "edge_ms": (received - sent - (token - start)) / 1e6,
                    "in_ms": (start - sent) / 1e6,
                    "out_ms": (received - token) / 1e6,
                }
            )
            await asyncio.sleep(gap_s)
    return out


def measure(kind: str, args: argparse.Namespace) -> list[dict[str, float]]:
    """One round: a fresh server process of `kind`, `args.requests` calls, the warm-up dropped."""
    ctx = mp.get_context("spawn")  # grpc in a forked child of a grpc process misbehaves
    ports = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(kind, args.work_ms / 1e3, ports), daemon=True)
    proc.start()
    try:
        port = ports.get(timeout=60)
        samples = asyncio.run(
            _drive(port, args.warmup + args.requests, args.prompt_tokens, args.gap_ms / 1e3)
        )
    finally:
        proc.terminate()
        proc.join(10)
    return samples[args.warmup :]


def summarize(samples: list[dict[str, float]]) -> dict[str, float]:
    return {
        f"{key}_{name}": round(fn([s[key] for s in samples]), 3)
        for key in ("edge_ms", "in_ms", "out_ms")
        for name, fn in (("p50", statistics.median), ("p90", lambda v: percentile(v, 90)))
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=200, help="timed calls a round")
    p.add_argument("--warmup", type=int, default=20, help="calls first, left out")
    p.add_argument("--rounds", type=int, default=2, help="rounds of each server, alternating")
    p.add_argument("--work-ms", type=float, default=4.0, help="the core's time to first token")
    p.add_argument("--gap-ms", type=float, default=20.0, help="idle time between calls")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)

    samples: dict[str, list[dict[str, float]]] = {kind: [] for kind in SERVERS}
    for _ in range(args.rounds):
        for kind in SERVERS:
            samples[kind] += measure(kind, args)
    results = {kind: summarize(s) for kind, s in samples.items()}
    bare = results["bare"]["edge_ms_p50"]
    print(
        f"one call at a time, {args.gap_ms:g} ms apart; the first token {args.work_ms:g} ms"
        " after the call reaches the server; ms"
    )
    header = ("edge p50", "p90", "in p50", "out p50", "over bare")
    print(f"{'server':8s} " + " ".join(f"{h:>9s}" for h in header))
    for kind, r in results.items():
        print(
            f"{kind:8s} {r['edge_ms_p50']:9.3f} {r['edge_ms_p90']:9.3f} {r['in_ms_p50']:9.3f}"
            f" {r['out_ms_p50']:9.3f} {r['edge_ms_p50'] - bare:9.3f}"
        )
    if args.out:
        write_result(args.out, "bench.grpc_edge", argv, config=vars(args), results=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
