"""The service harness lives in `bench.harness`; these names stay importable from here."""

from bench.harness import REPO, ServiceProcess, free_port, service_env

__all__ = ["REPO", "ServiceProcess", "free_port", "service_env"]
