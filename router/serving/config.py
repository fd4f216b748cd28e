"""Router settings (no Ray or gRPC imports: the CLI reads defaults before Ray loads)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from engine.core.waiting_queue import QueuePolicy
from router.edge.streams import StreamInterval, check_stream_interval
from router.routing.cache_aware import RoutingConfig
from router.routing.prefill_policy import (
    DEFAULT_LOCAL_PREFILL_MAX_TOKENS,
    DEFAULT_SLO_TPOT_MS,
    DEFAULT_SLO_TTFT_MS,
    PrefillPolicyConfig,
)


@dataclass(frozen=True)
class RouterConfig:
    max_in_flight: int = 256
    max_queue: int = 1024
    lease_s: float = 30.0  # a decode reservation not filled by then is freed
    reserve_poll_s: float = 0.02  # how often a request waiting for decode blocks retries
    # Upper bounds on phases with no client deadline, so a hung worker cannot hang a
    # request forever: prefill + hand-off, and the gap between two token batches.
    prefill_timeout_s: float = 600.0
    token_stall_timeout_s: float = 300.0
    # Lost attempts (a worker lost before any token reached the client, a refused or
    # broken hand-off) a request survives: it tries again on other workers.
    max_attempts: int = 3
    # Moves of one request off a decode or colocated worker lost after tokens were
    # streamed (router/serving/run/migrations.py); 0: such a request ends with an error.
    max_migrations: int = 3
    # Channels between decode workers (live migration on drain): made at the first drain
    # ("lazy") or as soon as a decode worker is live ("eager": a drain pays no set-up).
    decode_peer_channels: Literal["lazy", "eager"] = "lazy"
    # Tokens a stream message waits for after the first (router/edge/streams.py): a number
    # (1: every chunk at once), or "auto": chosen from the number of open streams.
    stream_interval: StreamInterval = "auto"
    retry_delay_s: float = 0.5  # times the attempt number
    # How long a request waits for a worker when a whole pool is down (being replaced).
    worker_wait_s: float = 60.0
    # Which worker runs a prompt: prefix-aware (cache overlap minus load) or least-loaded.
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    # Where prompts run (router/routing/prefill_policy.py): prompts with at most this many
    # tokens not already in the chosen decode worker's cache run there directly; longer
    # ones run there too when the prefill pool cannot meet the TTFT target and the
    # decode worker can take them within the TPOT target.
    local_prefill_max_tokens: int = DEFAULT_LOCAL_PREFILL_MAX_TOKENS
    slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS
    slo_tpot_ms: float = DEFAULT_SLO_TPOT_MS
    # The router's queue, ordered as the engines order theirs (engine.core.waiting_queue):
    # "fcfs", or "priority" (lower value first, aged by waiting).
    admission_policy: QueuePolicy = "fcfs"
    priority_aging_s: float = 10.0  # one priority level gained per this many seconds waited

    def __post_init__(self) -> None:
        self.prefill_policy  # noqa: B018 - validates the three fields it is made of
        if self.max_migrations < 0:
            raise ValueError("max_migrations must be >= 0 (0 = a lost worker fails its requests)")
        check_stream_interval(self.stream_interval)
        if self.decode_peer_channels not in ("lazy", "eager"):
            raise ValueError("decode_peer_channels must be 'lazy' or 'eager'")
        if self.priority_aging_s < 0:
            raise ValueError("priority_aging_s must be >= 0 (0 = no aging)")

    @property
    def prefill_policy(self) -> PrefillPolicyConfig:
        return PrefillPolicyConfig(
            self.local_prefill_max_tokens, self.slo_ttft_ms, self.slo_tpot_ms
        )


def keep_ray_on_loopback() -> None:
    """Make a local Ray instance use 127.0.0.1 instead of this host's network address.

    Ray reads this once, when it is first imported, so call it before importing ray.
    Only for a one-machine deployment: a cluster (--ray-address) needs real addresses.
    """
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
