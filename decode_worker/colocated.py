"""Colocated worker: one engine runs both phases (prompt and decode) of its requests.

For short prompts, where a KV hand-off buys nothing, the router can drive replicas of
this worker instead of prefill/decode pairs. It streams tokens exactly like a decode
worker (one long-poll message per batch of steps), so it reuses the decode worker's
outbox and abort handling and adds `submit`.
"""

from __future__ import annotations

from decode_worker.worker import DecodeWorker
from engine.core.outputs import GenerationInput


class ColocatedWorker(DecodeWorker):
    pool = "colocated"

    async def submit(self, inp: GenerationInput) -> None:
        """Queue a request; its tokens arrive through next_tokens()."""
        if self.is_buried(inp.req_id):
            return  # aborted before it got here
        # The router validated the prompt already.
        await self.on_engine(lambda: self.core.add_request(inp, validate=False))
