"""Metrics and traces of the router."""
