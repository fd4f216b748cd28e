"""Stop soak: start a service, stream, stop it the way a service manager does; many times.

    python -m bench.stop_soak --tries 20 --out stop_soak.json      # `make soak-stop`

Each try starts a 1P1D service on the embedded model in a session of its own, starts two
long streams and sends SIGTERM in one of the ways `bench.harness.stopping` names, in
turn. A try passes when every stream gets one final message within `--final-within-s`,
the process exits 0 within `--exit-within-s`, and none of its processes is left. Only
the group is drained with `--drain-grace-s`; the others keep the default grace (30 s),
so only the router noticing Ray going down ends the streams in time.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.stopping import STOP_MODES, stop_fresh_service
from bench.report import write_result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--tries", type=int, default=20)
    p.add_argument("--modes", nargs="+", choices=STOP_MODES, default=list(STOP_MODES))
    p.add_argument("--drain-grace-s", type=float, default=0.5, help="for the group mode")
    p.add_argument("--final-within-s", type=float, default=1.0)
    p.add_argument("--exit-within-s", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="JSON results")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    logs = Path(tempfile.mkdtemp(prefix="stop-soak-"))
    tries: list[dict[str, Any]] = []
    for n in range(args.tries):
        mode = args.modes[n % len(args.modes)]
        grace = args.drain_grace_s if mode == "group" else 30.0
        log = logs / f"try-{n:02d}.log"
        started = time.monotonic()
        result = stop_fresh_service(log, mode, grace, rng=rng)
        wrong = result.problems(args.final_within_s, args.exit_within_s)
        tries.append(
            {"mode": mode, "drain_grace_s": grace, **result.record(wrong), "log": str(log)}
        )
        print(
            f"try {n + 1:2d}/{args.tries} {mode:18s} final ≤ {result.worst_final_s:.2f} s  "
            f"exit {result.exit_code} after {result.exit_after_s:.2f} s  "
            f"({time.monotonic() - started:.0f} s)  {'ok' if not wrong else '; '.join(wrong)}",
            flush=True,
        )
    passed = sum(t["passed"] for t in tries)
    summary = {
        "passed": passed,
        "tries": len(tries),
        "worst_final_s": max(max(t["final_after_s"]) for t in tries),
        "worst_exit_s": max(t["exit_after_s"] for t in tries),
    }
    print(
        f"{passed}/{len(tries)} passed; worst final {summary['worst_final_s']:.2f} s, "
        f"worst exit {summary['worst_exit_s']:.2f} s (logs in {logs})"
    )
    if args.out:
        write_result(args.out, "bench.stop_soak", argv, summary=summary, tries=tries)
    return 0 if passed == len(tries) else 1


if __name__ == "__main__":
    sys.exit(main())
