"""Colocated worker: one engine runs both phases (prompt and decode) of its requests.

For short prompts, where a KV hand-off buys nothing, the router can drive replicas of
this worker instead of prefill/decode pairs. It is a decode worker that only ever gets
`submit`: it streams tokens the same way (one long-poll message per batch of steps)
and reuses the same abort handling.
"""

from __future__ import annotations

from decode_worker.worker import DecodeWorker
from engine.core.role import EngineRole
from engine.worker.contract import ColocatedCalls


class ColocatedWorker(DecodeWorker):
    pool = "colocated"
    role = EngineRole.COLOCATED
    contract = ColocatedCalls  # a decode worker's calls, less the KV hand-offs and moves


# The router's calls (engine/worker/contract.py), checked by mypy.
_ANSWERS: type[ColocatedCalls] = ColocatedWorker
