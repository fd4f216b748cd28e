"""What an engine is for: the one thing that differs between the pools' engines.

The scheduler, the factory and the workers read these properties instead of a flag each;
nothing else about an engine depends on its pool.
"""

from __future__ import annotations

import enum


class EngineRole(enum.Enum):
    COLOCATED = "colocated"  # runs prompts and decodes them (also the offline engine)
    PREFILL = "prefill"  # runs prompts, samples the first token, hands the KV off
    DECODE = "decode"  # decodes requests whose KV arrived, and short prompts itself

    @property
    def hands_off_after_first_token(self) -> bool:
        """A request leaves after its first token with its blocks still allocated: they
        hold the KV to hand off, and the worker releases them once it has gathered them."""
        return self is EngineRole.PREFILL

    @property
    def decodes(self) -> bool:
        """Runs pure decode steps, so CUDA graphs of them pay for their memory and
        start-up time, and scheduling one step ahead hides the host's work."""
        return self is not EngineRole.PREFILL
