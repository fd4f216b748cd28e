"""An attempt's stream: its worker's token updates, taken from its inbox, turned into the
client's text chunks until the request finishes.

The stream takes everything its inbox holds at once (router/serving/inbox.py), a message's
worth at a time (`--stream-interval`, router/edge/streams.py), detokenizes it, applies
stop strings, and reads what an update says about the attempt: the KV landed (the
reservation needs no more renewing), a hand-off was refused or broke (`WorkerLost`: the
next attempt runs on the decode worker), the request moved with its KV (`Moved`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sized
from dataclasses import replace

from engine.core.outputs import TextChunk
from engine.core.request import FinishReason
from router.edge.streams import tokens_per_message
from router.serving.config import RouterConfig
from router.serving.events import RequestObserver
from router.serving.inbox import Moved
from router.serving.interfaces import Aborts, Renewals, Started
from router.serving.run.attempts import Attempt, ClientRequest, WorkerLost


class ChunkStream:
    """Streams attempts; `open_streams` counts the requests in flight (the message size
    under `--stream-interval auto` grows with it)."""

    def __init__(
        self,
        config: RouterConfig,
        aborts: Aborts,
        renewals: Renewals,
        open_streams: Sized,
        observer: RequestObserver,
    ) -> None:
        self.config = config
        self.aborts = aborts
        self.renewals = renewals
        self.open_streams = open_streams
        self.observer = observer

    async def stream(
        self, request: ClientRequest, attempt: Attempt, start: Started
    ) -> AsyncIterator[TextChunk]:
        """Turn token updates into text chunks until the request finishes."""
        progress = request.progress
        tokens, reason, local = start.tokens, start.finish_reason, start.local
        while True:
            chunk, finish = progress.output.process(tokens, reason)
            if chunk is not None:
                progress.token_ids += chunk.token_ids
                if progress.t_first is None:
                    progress.t_first = time.perf_counter()
                    self.observer.first_token(request)
                yield chunk
            if finish is not None:
                if reason is None and attempt.decode_ref is not None:
                    # A stop string ended it here: the worker is still going.
                    self.aborts.abort(attempt.decode_ref, attempt.req_id)
                progress.finish_reason = finish
                return
            wanted = tokens_per_message(self.config.stream_interval, len(self.open_streams))
            stall_s = self.config.token_stall_timeout_s
            try:  # the first token alone, then a message's worth
                item = await attempt.inbox.take(stall_s, wanted if progress.t_first else 1)
            except TimeoutError as exc:
                raise RuntimeError(f"no token for {stall_s:.0f}s") from exc
            if attempt.decode_ref is not None:
                # The decode worker answered for the request: its reservation is used.
                self.renewals.release(attempt.decode_ref, attempt.req_id)
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, Moved):
                # It moved with its KV (router/serving/live_migration.py): stream what the
                # client has not seen of the old attempt's tokens; the new attempt's follow.
                tokens = item.outputs[progress.num_out - item.first_index :]
                reason, local = None, None
                progress.num_moved += 1
                continue
            if item.kv_wire_s and not attempt.resumes_after:
                progress.timings = replace(
                    progress.timings, kv_wire_s=item.kv_wire_s, kv_transfer_s=item.kv_handoff_s
                )
            if item.finish_reason is FinishReason.ERROR:
                # A refused or broken hand-off, or an expired reservation: the decode pool
                # is up, so the next attempt runs there from what was streamed.
                error = item.error or "the decode worker reported an error"
                raise WorkerLost(error, run_locally=True)
            if local is not None and item.new_token_ids:
                local.done_with_tokens(item.phases.compute_s if item.phases else None)
            tokens, reason = item.new_token_ids, item.finish_reason
            progress.note_cached(attempt, item.num_cached_tokens)
