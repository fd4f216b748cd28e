"""Where a request goes: placement, cache-aware choice, the local-prefill rule, load accounts."""
