"""What tests and benchmarks share to drive a real service from outside.

* `service`: `pdserve serve` as a subprocess on a free loopback port (`ServiceProcess`,
  `service_process`);
* `ports`: `free_port`;
* `polling`: deadline-bounded waits (`wait_until`, `wait_until_async`);
* `streams`: one Generate call read to its end (`generate` → `StreamResult`);
* `pools`: `live_workers`, `wait_pool_sizes`;
* `metrics`: the Prometheus endpoint (`scrape`, `value`);
* `tp_ranks`: `end_rank`, the end of a tensor-parallel rank spawned by a benchmark or test.

Nothing here imports from `tests/`; tests import from here (and tests/services.py adds
what only tests use).
"""

from bench.harness.polling import wait_until, wait_until_async
from bench.harness.ports import free_port
from bench.harness.service import (
    REPO,
    ServiceExitError,
    ServiceProcess,
    service_env,
    service_process,
)

__all__ = [
    "REPO",
    "ServiceExitError",
    "ServiceProcess",
    "free_port",
    "service_env",
    "service_process",
    "wait_until",
    "wait_until_async",
]
