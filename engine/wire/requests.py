"""A request on its way through the workers, and the prefill pool's answer.

A request reaches a worker as a `GenerationInput`; a hand-off is addressed by a
`HandoffTarget` and filled into a `Reservation`; the prefill pool answers with a
`PrefillResult`. A live move takes a running request off its worker as a
`DetachedRequest` (`Precopy` and `DetachedMove` name its rounds). Where a request's time
went on a worker rides along as a `PhaseReport`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from engine.core.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.wire.workers import KVEvents


@dataclass(frozen=True)
class GenerationInput:
    """A validated request as the frontends (offline API, router) hand it to a backend.

    Exactly one of `prompt`, `prompt_token_ids` or `messages` was given by the
    user; the frontend has already rendered and tokenized it into `prompt_token_ids`.
    """

    req_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    priority: int = 0
    # The W3C trace-context carrier of the router's span for this attempt; empty when the
    # request is not traced (then workers record no spans for it). Not part of the
    # request's identity.
    trace_context: dict[str, str] = field(default_factory=dict, compare=False)
    # The router process that owns the request (a decode worker sends its updates to that
    # consumer's `next_tokens`; "" is the only one of a single-process router), and the
    # client's id for it, by which another router process may re-attach to it
    # (docs/architecture.md, Router tier). Neither is part of the request's identity.
    consumer: str = field(default="", compare=False)
    request_id: str = field(default="", compare=False)


@dataclass(frozen=True)
class HandoffTarget:
    """Where a request's KV goes: the receiving worker and its incarnation."""

    worker_id: str
    epoch: int


@dataclass(frozen=True)
class Reservation:
    """Blocks a receiving worker holds for one request's incoming KV."""

    worker_id: str
    epoch: int
    block_ids: tuple[int, ...]
    # Leading blocks whose KV is there already (a live move's pre-copy): the sender
    # sends only the blocks after them.
    num_precopied: int = 0

    @property
    def target(self) -> HandoffTarget:
        return HandoffTarget(self.worker_id, self.epoch)


@dataclass(frozen=True)
class PhaseReport:
    """Where one request's time went on one worker, in seconds (None: the phase did not
    run there, or not in this message). The router turns these into its per-worker
    phase histograms; each phase is reported once."""

    queue_s: float | None = None  # waiting in the worker's engine queue for a first step
    compute_s: float | None = None  # its prompt: first step to first token (cached or not)
    transfer_s: float | None = None  # its KV: ready on the sender to in place here
    # Of transfer_s: the sender posting the message's last header (a streamed message's
    # trailer) to this worker reading it (the sending lane, the control channel and the
    # receiving thread's wake-up); the rest is the payload's last bytes landing.
    kv_signal_s: float | None = None
    # Bytes of its KV received in a whole message (0 for a streamed one, whose receive
    # waits on the sender's pass), and its share by bytes of that message's receive
    # time: summed, the time the channel spent receiving, the true bandwidth's divisor.
    wire_bytes: int = 0
    wire_s: float = 0.0
    admission_s: float | None = None  # KV in place to its first decode step scheduled
    first_step_s: float | None = None  # that step scheduled to its token out

    def merged(self, later: PhaseReport) -> PhaseReport:
        """Both reports in one (each phase is set in at most one of them)."""
        values = {
            f.name: getattr(later, f.name) if getattr(later, f.name) else getattr(self, f.name)
            for f in fields(self)
        }
        return PhaseReport(**values)


@dataclass(frozen=True)
class DetachedRequest:
    """A running request taken off its decode engine to move elsewhere, its KV kept: the
    tokens so far (prompt and outputs) and how many of them the kept KV covers (all but
    the last, which the next step would have computed)."""

    token_ids: tuple[int, ...]
    num_kv_tokens: int

    @property
    def next_token(self) -> int:
        """The token the receiver continues from (sampled, its KV not yet computed)."""
        return self.token_ids[self.num_kv_tokens]


@dataclass(frozen=True)
class DetachedMove:
    """A detached request on its way to a peer: its id on the source, the id the target
    reserved blocks under, and what `detach` returned."""

    req_id: str
    as_req_id: str
    detached: DetachedRequest
    skip_blocks: int = 0  # leading blocks the target has from a pre-copy: not sent again


@dataclass(frozen=True)
class Precopy:
    """A running request whose full blocks go to a peer ahead of its move: its id on the
    source and the id the peer will hold them under (the move's new id)."""

    req_id: str
    as_req_id: str


@dataclass(frozen=True)
class Handover:
    """A request a decode worker hands to another router process (a resumed stream):
    the attempt's input, every token it produced so far, and its end if it ended while
    nobody read it. `waiting_for_kv`: its KV has not landed yet; its first token will
    come as its first update."""

    inp: GenerationInput
    output_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    error: str = ""
    waiting_for_kv: bool = False


@dataclass(frozen=True)
class PrefillResult:
    """A prefill worker's answer: the first token, and how the request goes on."""

    first_token: int | None
    # None: the KV is on its way to the target, which continues the request. Otherwise
    # the request ended here (STOP/LENGTH on its first token, ABORT, or ERROR with
    # `error`: then nothing was sent and the caller may run it elsewhere).
    finish_reason: FinishReason | None
    num_cached_tokens: int
    prefill_s: float
    transfer_bytes: int = 0  # posted on the channel (arrival is the receiver's to report)
    error: str = ""
    kv_events: tuple[KVEvents, ...] = ()  # this worker's prefix-cache changes, for routing
    phases: PhaseReport | None = None  # queue and compute on the prefill worker
