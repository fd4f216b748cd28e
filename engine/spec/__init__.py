"""Speculative decoding: configuration, n-gram and draft-model proposers."""
