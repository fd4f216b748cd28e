"""One router process of a tier SIGKILLed under load: what the other processes' calls,
the broken streams and new calls notice.

A service with `--router-processes N` (default 4; the embedded model, one prefill and
one decode worker) gets `--streams` greedy generations at once through resumable
clients (`router.cli.client.resumable_generate`, each call on a connection of its own,
so the kernel spreads them over the processes), twice: undisturbed, then with router
process `--victim` SIGKILLed once every stream has a few tokens. Reported: the streams
that broke (those the victim carried) and were resumed, every stream's tokens against
the undisturbed run's, the calls that failed (none should), the new calls sent every
50 ms from the kill on (each taken by a survivor at once, or failed), and how long the
owner took to have the victim listening again.

    python -m bench.router_kill --out router_kill.json    # the service's log: router_kill.log
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shlex
import signal
import time
from pathlib import Path
from typing import Any

import grpc

from bench.harness.polling import wait_until_async
from bench.harness.ports import free_port_run
from bench.harness.service import ServiceProcess, service_process
from bench.report import text_table, write_result
from router.cli.client import resumable_generate, stream_generate


def pids_of(svc: ServiceProcess, index: int) -> list[int]:
    """Every pid router process `index` ran as, in order, from the service's log."""
    pattern = rf"router process {index} started \(pid (\d+)\)"
    return [int(p) for p in re.findall(pattern, svc.log_tail(10**8))]


async def run_streams(
    address: str, prompts: list[str], max_tokens: int, on_progress: list[int], tag: str
) -> tuple[list[list[int]], list[int], list[str]]:
    """Every prompt's stream: its tokens, the resumes it needed, and its error if any."""
    resumes = [0] * len(prompts)
    errors = [""] * len(prompts)

    async def one(i: int) -> list[int]:
        tokens: list[int] = []

        def resumed(received: int, exc: grpc.aio.AioRpcError) -> None:
            resumes[i] += 1

        try:
            async for response in resumable_generate(
                address,
                prompt=prompts[i],
                request_id=f"{tag}-{i}",
                on_resume=resumed,
                max_tokens=max_tokens,
                temperature=0.0,
                ignore_eos=True,
            ):
                tokens.extend(response.token_ids)
                on_progress[i] = len(tokens)
        except grpc.aio.AioRpcError as exc:
            errors[i] = f"{exc.code().name}: {exc.details()}"
        return tokens

    tokens = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return list(tokens), resumes, errors


async def probe(address: str, start: float, until: float) -> list[tuple[float, float, str]]:
    """A one-token call every 50 ms until `until`: (when it was sent, s after `start`;
    its latency, s; its error or "")."""
    calls: list[Any] = []

    async def one() -> tuple[float, float, str]:
        t0 = time.monotonic()
        error = ""
        try:
            async for _ in stream_generate(address, prompt="Hi", max_tokens=1, timeout=10):
                pass
        except grpc.aio.AioRpcError as exc:
            error = exc.code().name
        return t0 - start, time.monotonic() - t0, error

    while time.monotonic() < until:
        calls.append(asyncio.ensure_future(one()))
        await asyncio.sleep(0.05)
    return list(await asyncio.gather(*calls))


async def disturbed(
    svc: ServiceProcess, args: argparse.Namespace, prompts: list[str]
) -> dict[str, Any]:
    progress = [0] * len(prompts)
    streams = asyncio.ensure_future(
        run_streams(svc.address, prompts, args.max_tokens, progress, "kill")
    )
    await wait_until_async(lambda: min(progress) >= 4, timeout=300)
    (victim,) = pids_of(svc, args.victim)[-1:]
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    probes = asyncio.ensure_future(probe(svc.address, killed, killed + args.probe_s))
    listening = re.compile(rf"router process {args.victim} \(pid (?!{victim}\))\d+\) is listening")
    await wait_until_async(lambda: listening.search(svc.log_tail(10**8)) is not None, timeout=60)
    restarted_s = time.monotonic() - killed
    tokens, resumes, errors = await streams
    probed = await probes
    return dict(tokens=tokens, resumes=resumes, errors=errors, probes=probed, restart_s=restarted_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--router-processes", type=int, default=4)
    p.add_argument("--victim", type=int, default=2, help="the router process killed (1..N-1)")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--probe-s", type=float, default=3.0, help="new calls sent this long")
    p.add_argument("--serve-args", default="", help="more `pdserve serve` flags, one string")
    p.add_argument("--out", type=Path, default=Path("bench/results/router_kill.json"))
    args = p.parse_args()
    if not 1 <= args.victim < args.router_processes:
        p.error("--victim: a router process other than the owner (1 .. N - 1)")
    prompts = [f"Question {i}: tell me about the number {i}." for i in range(args.streams)]
    serve = ["--router-processes", str(args.router_processes)]
    serve += ["--metrics-port", str(free_port_run(args.router_processes))]
    serve += shlex.split(args.serve_args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with service_process(serve, args.out.with_suffix(".log")) as svc:
        svc.wait_serving(600)
        progress = [0] * len(prompts)
        reference, _, ref_errors = asyncio.run(
            run_streams(svc.address, prompts, args.max_tokens, progress, "undisturbed")
        )
        assert not any(ref_errors), f"the undisturbed run failed: {ref_errors}"
        got = asyncio.run(disturbed(svc, args, prompts))
    broken = [i for i, n in enumerate(got["resumes"]) if n]
    failed = [e for e in got["errors"] if e]
    differing = [i for i, t in enumerate(got["tokens"]) if t != reference[i]]
    probes = got["probes"]
    probe_failed = [(round(sent, 3), e) for sent, _, e in probes if e]
    answered = sorted(latency for _, latency, e in probes if not e)
    summary = {
        "router_processes": args.router_processes,
        "streams": args.streams,
        "broken_and_resumed": len(broken),
        "failed": len(failed),
        "differing_from_undisturbed": len(differing),
        "new_calls": len(probes),
        "new_calls_failed": len(probe_failed),
        "new_call_latency_p50_s": answered[len(answered) // 2] if answered else None,
        "new_call_latency_max_s": answered[-1] if answered else None,
        "new_calls_failed_sent_at_s": [sent for sent, _ in probe_failed],
        "listening_again_s": got["restart_s"],
    }
    rows = [[k, v if not isinstance(v, float) else round(v, 3)] for k, v in summary.items()]
    print("\n".join(text_table(["measure", "value"], rows, title="router process killed")))
    write_result(
        args.out, "bench.router_kill", None, **summary, errors=failed + [e for _, e in probe_failed]
    )


if __name__ == "__main__":
    main()
