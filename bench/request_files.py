"""Which product files one Generate request passes through, in every process of a service.

Starts `pdserve serve ARGS` (default: the embedded model, one prefill and one decode
worker) with a `sitecustomize` on its path that every Python process of the service
imports first, the router and each Ray worker alike: it records the file of each Python
function called, while a control file says so. After a warm-up request, two windows of
the same length are recorded: one idle, one with a single Generate call. The request's
files are those the request window called into and the idle one did not (what runs
anyway: health checks, statistics polls, idle loops), restricted to the product
packages; the files of both windows (the worker's loop, the scheduler) are counted
beside them. Prints them by package and writes JSON:

    python -m bench.request_files --out bench/results/request_files.json
    python -m bench.request_files --repeat 40   # a prompt long enough to be handed off

Functions of threads that C code starts (rather than Python's `threading`) are not seen.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import tempfile
import time
from collections import defaultdict
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from bench.harness import REPO, service_process
from bench.harness.streams import StreamResult, generate
from bench.report import write_result

PRODUCT = ("router", "engine", "prefill_worker", "decode_worker")
DEFAULT_OUT = Path("bench/results/request_files.json")
# Imported first by every Python process started with this folder on its path; records
# nothing unless CALLED_FILES_DIR is set. A poller thread reads the control file: "on"
# starts a fresh record, "off:NAME" writes it to NAME.<pid>.json.
SITECUSTOMIZE = """
import json, os, sys, threading, time
_dir = os.environ.get("CALLED_FILES_DIR")
if _dir:
    _files, _on = set(), [False]
    def _profile(frame, event, arg):
        if _on[0] and event == "call":
            _files.add(frame.f_code.co_filename)
    sys.setprofile(_profile)
    threading.setprofile(_profile)
    def _poll():
        seen = ""
        while True:
            time.sleep(0.02)
            try:
                with open(os.path.join(_dir, "control")) as f:
                    cmd = f.read().strip()
            except OSError:
                continue
            if cmd == seen:
                continue
            seen = cmd
            if cmd == "on":
                _files.clear()
                _on[0] = True
            elif cmd.startswith("off:"):
                _on[0] = False
                path = os.path.join(_dir, f"{cmd[4:]}.{os.getpid()}.json")
                with open(path, "w") as f:
                    json.dump(sorted(_files), f)
    threading.Thread(target=_poll, daemon=True).start()
"""


def product_files(paths: set[str]) -> set[str]:
    """The repository-relative paths among `paths` in a product package."""
    out = set()
    for p in paths:
        try:
            rel = Path(p).resolve().relative_to(REPO)
        except ValueError:
            continue
        if rel.parts and rel.parts[0] in PRODUCT:
            out.add(str(rel))
    return out


def recorded(folder: Path, name: str) -> set[str]:
    """Every process's record of window `name`, merged."""
    files: set[str] = set()
    for path in folder.glob(f"{name}.*.json"):
        files.update(json.loads(path.read_text()))
    return files


def window(
    folder: Path, name: str, seconds: float, during: Coroutine[Any, Any, object] | None = None
) -> set[str]:
    """Record for `seconds` (running the coroutine `during` inside), then collect."""
    control = folder / "control"
    control.write_text("on")
    time.sleep(0.2)  # every process's poller has read it
    t0 = time.monotonic()
    if during is not None:
        asyncio.run(during)
    time.sleep(max(0.0, seconds - (time.monotonic() - t0)))
    control.write_text(f"off:{name}")
    time.sleep(0.5)
    return product_files(recorded(folder, name))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve-args", default="", help="`pdserve serve` flags, one string")
    p.add_argument("--prompt", default="Name three colours of the rainbow.")
    p.add_argument("--repeat", type=int, default=1, help="the prompt this many times over")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--window-s", type=float, default=0.0, help="default: the request's time + 1")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "hook").mkdir()
        (folder / "hook" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        path = os.pathsep.join(filter(None, [str(folder / "hook"), os.environ.get("PYTHONPATH")]))
        env = {"CALLED_FILES_DIR": str(folder), "PYTHONPATH": path}
        with service_process(shlex.split(args.serve_args), folder / "service.log", env=env) as svc:
            svc.wait_serving(600)

            def request(n: int) -> Coroutine[Any, Any, StreamResult]:
                # A prompt of its own each time: a cached one would take a shorter path.
                prompt = f"Request {n}. " + args.prompt * args.repeat
                return generate(svc.address, prompt=prompt, max_tokens=args.max_tokens)

            t0 = time.monotonic()
            first = asyncio.run(request(0))
            seconds = args.window_s or (time.monotonic() - t0) + 1.0
            assert first.final is not None, f"the warm-up request failed: {first.details}"
            idle = window(folder, "idle", seconds)
            busy = window(folder, "request", seconds, request(1))
    files = sorted(busy - idle)
    by_package: dict[str, list[str]] = defaultdict(list)
    for f in files:
        by_package[f.split("/")[0]].append(f)
    for package, names in sorted(by_package.items()):
        print(f"{package:<16} {len(names):>3}  " + " ".join(n.split("/", 1)[1] for n in names))
    both = sorted(busy & idle)
    print(f"{'request only':<16} {len(files):>3}  (window {seconds:.1f} s)")
    print(f"{'idle loops too':<16} {len(both):>3}  " + " ".join(both))
    print(f"{'request window':<16} {len(busy):>3}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(
        args.out,
        "bench.request_files",
        None,
        files=files,
        count=len(files),
        request_window_count=len(busy),
        also_idle=both,
        window_s=seconds,
    )


if __name__ == "__main__":
    main()
