"""A real Prometheus server (the `prometheus` binary) on loopback, scraping a service
with the repository's own configuration (deploy/prometheus/), for tests that check the
dashboard's queries and the alerting rules against live data."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from bench.harness.polling import wait_until
from bench.harness.ports import free_port
from bench.harness.service import REPO

DEPLOY = REPO / "deploy" / "prometheus"


def find_binary(name: str) -> str | None:
    """`prometheus` or `promtool` on PATH (Debian package `prometheus`), or None."""
    return shutil.which(name)


class PrometheusServer:
    """`with PrometheusServer(workdir, "127.0.0.1:9400") as prom:` scrapes that target
    every `interval` as job "pdserve", with deploy/prometheus/pdserve-rules.yml loaded."""

    def __init__(self, workdir: Path, target: str, interval: str = "1s") -> None:
        binary = find_binary("prometheus")
        if binary is None:
            raise FileNotFoundError("prometheus is not installed")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
        config["global"].update(scrape_interval=interval, evaluation_interval=interval)
        config["rule_files"] = [str(DEPLOY / name) for name in config["rule_files"]]
        config["scrape_configs"][0]["static_configs"] = [{"targets": [target]}]
        config_path = workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in __exit__
        self._proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def _get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as resp:
            return json.loads(resp.read()) if path.startswith("/api/") else resp.status

    def _ready(self) -> bool:
        if self._proc.poll() is not None:
            raise RuntimeError(f"prometheus exited:\n{self.log_path.read_text()[-2000:]}")
        try:
            return self._get("/-/ready") == 200
        except OSError:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result (ValueError with Prometheus's message if it fails)."""
        try:
            answer = self._get("/api/v1/query", query=expr)
        except urllib.error.HTTPError as exc:  # a bad query is a 400 with the reason
            answer = json.loads(exc.read())
        if answer["status"] != "success":
            raise ValueError(f"{expr}: {answer.get('error')}")
        return list(answer["data"]["result"])

    def numbers(self, expr: str) -> list[float]:
        """The query's values that are numbers (NaN, e.g. 0/0, left out)."""
        values = [float(r["value"][1]) for r in self.query(expr)]
        return [v for v in values if not math.isnan(v)]

    def targets_up(self) -> bool:
        """Every scrape target answered its last scrape."""
        active = self._get("/api/v1/targets")["data"]["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)

    def scrapes(self) -> list[str]:
        """Each target's last scrape: health, duration and error, for failure messages."""
        active = self._get("/api/v1/targets")["data"]["activeTargets"]
        return [
            f"{t['scrapeUrl']}: {t['health']} in {t.get('lastScrapeDuration', 0):.3f} s"
            + (f" ({t['lastError']})" if t.get("lastError") else "")
            for t in active
        ]

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule with its health, state and last error."""
        groups = self._get("/api/v1/rules")["data"]["groups"]
        return [rule for group in groups for rule in group["rules"]]

    def __enter__(self) -> PrometheusServer:
        try:
            wait_until(self._ready, 60, interval=0.2, what="prometheus ready")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()
