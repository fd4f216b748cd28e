"""The garbage collector and a serving process's long-lived heap."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Move every object alive once a process is warm (modules, the model's Python
    objects, clients, the tokenizer) out of the garbage collector's sight: they live as
    long as the process, and each full collection would otherwise walk them all again,
    holding the interpreter's lock for tens to hundreds of milliseconds while a step or
    the token stream waits (vLLM and SGLang do the same after start-up)."""
    gc.collect()
    gc.freeze()
