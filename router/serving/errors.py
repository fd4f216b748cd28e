"""Errors the serving core raises to the edge; each maps to one gRPC status code."""

from __future__ import annotations


class QueueFullError(Exception):
    """The admission queue is full (RESOURCE_EXHAUSTED): the client should back off."""


class NotReadyError(Exception):
    """The server is warming up or draining (UNAVAILABLE): retry elsewhere or later."""


class ResumeNotFoundError(LookupError):
    """A resumed call names no request that is still decoding (NOT_FOUND)."""


class InvalidRequestError(ValueError):
    """A request field is out of range (INVALID_ARGUMENT); the message names field and limit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
