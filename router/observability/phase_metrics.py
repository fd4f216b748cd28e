"""Where requests' time goes on each worker: phase histograms, per pool and worker.

Workers measure a request's phases (engine/worker/phases.py) and send them with the
replies and token batches the router receives anyway (`PhaseReport` in the wire
types); the serving core hands each report to `observe`. The histograms live on the
router's registry, so the one /metrics endpoint serves them.

The KV channel's bandwidth is the bytes received over the time the channel was busy
receiving them (`pdserve_kv_wire_bytes_total` over `pdserve_kv_wire_seconds_total`), not
over wall time: idle gaps between hand-offs would otherwise read as a slow link. Only
whole messages count: a streamed one's receive waits on the sender's forward pass.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Histogram

from engine.wire import PhaseReport

# Seconds, 100 µs to 10 min: a GPU's decode step and KV transfer (sub-millisecond to
# tens of milliseconds) and a CPU's queued prompt (seconds to minutes) alike.
PHASE_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip

LABELS = ("pool", "worker")  # worker: its index in the pool, as in the pool gauges


class PhaseMetrics:
    """The phase histograms and the KV receive counters, on one registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=PHASE_BUCKETS, registry=registry)

        self.queue = histogram(
            "pdserve_phase_queue_seconds",
            "Time a request waited in a worker's engine queue for its first step.",
        )
        self.prefill = histogram(
            "pdserve_phase_prefill_seconds",
            "Time from a request's first step on a worker to its first token (its prompt).",
        )
        self.kv_transfer = histogram(
            "pdserve_phase_kv_transfer_seconds",
            "Time from a request's KV ready on the prefill worker to in place on this "
            "decode worker.",
        )
        self.kv_signal = histogram(
            "pdserve_phase_kv_signal_seconds",
            "Of the KV transfer: time from the prefill worker posting a hand-off's last "
            "header (a streamed one's trailer) to this decode worker reading it; the rest "
            "of the transfer waited for the last bytes.",
        )
        self.decode_admission = histogram(
            "pdserve_phase_decode_admission_seconds",
            "Time from a request's KV in place on a decode worker to its first decode step.",
        )
        self.first_decode_step = histogram(
            "pdserve_phase_first_decode_step_seconds",
            "Time from a request's first decode step scheduled to its token out.",
        )
        self.kv_wire_bytes = Counter(
            "pdserve_kv_wire_bytes",
            "Bytes of KV a decode worker received in whole messages (streamed ones, sent "
            "during the prefill pass, are left out).",
            LABELS,
            registry=registry,
        )
        self.kv_wire_seconds = Counter(
            "pdserve_kv_wire_seconds",
            "Time a decode worker's KV channels spent receiving those bytes (divide the "
            "bytes by it for the bandwidth while transferring).",
            LABELS,
            registry=registry,
        )

    def observe(self, pool: str, index: int, phases: PhaseReport) -> None:
        """Record what one report says about the worker `pool`/`index`."""
        labels = (pool, str(index))
        for histogram, seconds in (
            (self.queue, phases.queue_s),
            (self.prefill, phases.compute_s),
            (self.kv_transfer, phases.transfer_s),
            (self.kv_signal, phases.kv_signal_s),
            (self.decode_admission, phases.admission_s),
            (self.first_decode_step, phases.first_step_s),
        ):
            if seconds is not None:
                histogram.labels(*labels).observe(seconds)
        if phases.wire_bytes:
            self.kv_wire_bytes.labels(*labels).inc(phases.wire_bytes)
            self.kv_wire_seconds.labels(*labels).inc(phases.wire_s)


_default: PhaseMetrics | None = None
_lock = threading.Lock()


def get_phase_metrics() -> PhaseMetrics:
    """This process's phase metrics, on the router's registry (created on first use)."""
    global _default
    with _lock:
        if _default is None:
            from router.observability.metrics import get_metrics

            _default = PhaseMetrics(get_metrics().registry)
        return _default


def observe(pool: str, index: int, phases: PhaseReport | None) -> None:
    """A worker's report on one request (None: nothing to record)."""
    if phases is not None:
        (_default or get_phase_metrics()).observe(pool, index, phases)
