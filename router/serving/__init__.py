"""The serving core: each request's run through admission, placement, prefill, hand-off,
decode and delivery."""
