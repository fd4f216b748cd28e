"""A request's phases on a worker: measured for the router's phase histograms (always),
and recorded as spans of the request's trace (when it carries one).

The phases, each from two readings of `time.monotonic()` on the worker:
* queue: the call reached the worker → a step first scheduled the request;
* compute: that step → its first token (the prompt's chunks, cached or not);
* KV transfer: the KV ready on the sender → in place on the receiver (`KVArrival`),
  with the bytes and the receive time that give the channel's true bandwidth (whole
  messages only: a streamed one's receive waits on the sender's pass);
* decode admission: the KV in place → the decode engine's first step for it;
* first decode step: that step → its token out.

Spans are children of the router's span for the attempt (the carrier in the request's
`GenerationInput`), named `<pool>.queue`, `<pool>.compute`, `kv.send`, `kv.transfer`
(with `kv.receive` inside), `decode.admission` and `decode.first_step`.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine import tracing
from engine.transfer.base import KVPoll
from engine.transfer.import_target import KVArrival
from engine.wire import (
    GenerationInput,
    HandoffHeader,
    HandoffTarget,
    PhaseReport,
    TokenUpdate,
    epoch_hex,
)


@dataclass(frozen=True)
class Waiting:
    """A request on this worker that has not produced a token yet, and since when."""

    inp: GenerationInput
    since: float  # time.monotonic(): the call arrived (a prompt), or its KV landed
    imported: bool  # its KV came from another worker: admission, then a decode step


def prompt_phases(
    pool: str, worker_id: str, inp: GenerationInput, since: float, first: TokenUpdate, at: float
) -> PhaseReport:
    """Queue and compute of a prompt run here: the call arrived at `since`, its first
    token (`first`) came out at `at`."""
    scheduled = first.scheduled_at or since
    if inp.trace_context and tracing.enabled():
        parent = tracing.extract(inp.trace_context)
        where = {"pdserve.pool": pool, "pdserve.worker": worker_id}
        boundary = tracing.wall_ns(scheduled)  # once: the two spans meet exactly
        tracing.record(f"{pool}.queue", parent, tracing.wall_ns(since), boundary, where)
        tracing.record(
            f"{pool}.compute",
            parent,
            boundary,
            tracing.wall_ns(at),
            {
                **where,
                "pdserve.prompt_tokens": len(inp.prompt_token_ids),
                "pdserve.cached_tokens": first.num_cached_tokens,
            },
        )
    return PhaseReport(queue_s=max(0.0, scheduled - since), compute_s=max(0.0, at - scheduled))


def decode_start_phases(
    worker_id: str, waiting: Waiting, first: TokenUpdate, at: float
) -> PhaseReport:
    """Admission and first step of a request whose KV landed here at `waiting.since`."""
    scheduled = first.scheduled_at or waiting.since
    inp = waiting.inp
    if inp.trace_context and tracing.enabled():
        parent = tracing.extract(inp.trace_context)
        where = {"pdserve.pool": "decode", "pdserve.worker": worker_id}
        boundary = tracing.wall_ns(scheduled)  # once: the two spans meet exactly
        tracing.record("decode.admission", parent, tracing.wall_ns(waiting.since), boundary, where)
        tracing.record("decode.first_step", parent, boundary, tracing.wall_ns(at), where)
    return PhaseReport(
        admission_s=max(0.0, scheduled - waiting.since), first_step_s=max(0.0, at - scheduled)
    )


def arrival_phases(worker_id: str, arrival: KVArrival) -> PhaseReport:
    """The KV transfer as the receiver saw it (the span runs from the sender's clock)."""
    inp = arrival.inp
    if inp.trace_context and tracing.enabled():
        header = arrival.header
        end_ns = tracing.wall_ns(arrival.received_at)
        span = tracing.start(
            "kv.transfer",
            tracing.extract(inp.trace_context),
            min(header.posted_at_us * 1000, end_ns),
            {
                **_pair(arrival.peer_id, worker_id, header),
                "pdserve.kv.bytes": arrival.num_bytes,
                "pdserve.kv.streamed": arrival.streamed,
                "pdserve.kv.wire_s": arrival.wire_s,
                "pdserve.kv.handoff_s": arrival.handoff_s,
                "pdserve.kv.signal_s": arrival.signal_s,
            },
        )
        wire_ns = int(arrival.wire_s * 1e9)
        tracing.record(
            "kv.receive",
            tracing.context_of(span),
            end_ns - wire_ns,
            end_ns,
            {"pdserve.worker": worker_id, "pdserve.kv.message_bytes": header.num_bytes},
        )
        span.end(end_time=end_ns)
    if arrival.streamed:  # its receive time is mostly the sender's pass, not the wire's
        return PhaseReport(transfer_s=arrival.handoff_s, kv_signal_s=arrival.signal_s)
    return PhaseReport(
        transfer_s=arrival.handoff_s,
        kv_signal_s=arrival.signal_s,
        wire_bytes=arrival.num_bytes,
        wire_s=arrival.active_s,
    )


def record_kv_send(
    worker_id: str,
    inp: GenerationInput,
    target: HandoffTarget,
    header: HandoffHeader | None,
    num_bytes: int,
    span: tuple[float, float],
    outcome: KVPoll,
    failure: str = "",
) -> None:
    """The sender's side of a hand-off, from the KV ready to the send done (`span`, in
    time.monotonic() readings; `header` None: a streamed message, whose parts left
    during the pass); only for a traced request."""
    if not inp.trace_context or not tracing.enabled():
        return
    start, end = span
    attributes: dict[str, tracing.AttributeValue] = {
        "pdserve.kv.pair": f"{worker_id}->{target.worker_id}",
        "pdserve.kv.dst_epoch": epoch_hex(target.epoch),
        "pdserve.kv.streamed": header is None,
        "pdserve.kv.bytes": num_bytes,
        "pdserve.kv.outcome": outcome.name.lower(),
    }
    if header is not None:
        attributes |= _pair(worker_id, target.worker_id, header)
    if failure:
        attributes["pdserve.kv.failure"] = failure
    tracing.record_under(
        inp.trace_context, "kv.send", tracing.wall_ns(start), tracing.wall_ns(end), attributes
    )


def _pair(sender: str, receiver: str, header: HandoffHeader) -> dict[str, tracing.AttributeValue]:
    return {
        "pdserve.kv.pair": f"{sender}->{receiver}",
        "pdserve.kv.src_epoch": epoch_hex(header.src_epoch),
        "pdserve.kv.dst_epoch": epoch_hex(header.dst_epoch),
        "pdserve.kv.seq_no": header.seq_no,
        "pdserve.kv.message_bytes": header.num_bytes,
        "pdserve.kv.message_entries": len(header.entries),
    }
