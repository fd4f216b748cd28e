"""Deployment files: valid for Ray's and KubeRay's schemas, `pdserve serve` in each parses,
and the clusters can grow as far as the planner may size each pool.

KubeRay's CRDs and the ray-cluster chart are read from ../shared/reference/kuberay next to
the repository; tests that need them are skipped where they are absent.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import yaml
from google.protobuf import json_format

from pdserve.v1 import generation_pb2 as pb
from router.cli import build_parser
from router.flag_checks import check_planner_flags, given_flags

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
KUBERAY_REF = REPO.parent / "shared" / "reference" / "kuberay"
DEPLOY_FILES = (
    DEPLOY / "ray" / "cluster.yaml",
    DEPLOY / "kuberay" / "raycluster.yaml",
    DEPLOY / "kuberay" / "values.yaml",
)
# Shell text that ends a command: separators, redirections, backgrounding.
_COMMAND_END = re.compile(r"\s(?:&&|\|\||;|\||>|2>|&)(?:\s|$)|;|\n")


def needs_kuberay_reference(sub: str) -> Path:
    path = KUBERAY_REF / sub
    if not path.exists():
        pytest.skip(f"KubeRay reference files not found at {path}")
    return path


def strings(node: Any) -> Iterator[str]:
    """Every string value in a YAML document."""
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from strings(value)


def serve_commands(path: Path) -> list[list[str]]:
    """argv (after `pdserve`) of every `pdserve serve ...` command in a deploy file."""
    commands = []
    for doc in yaml.safe_load_all(path.read_text()):
        for text in strings(doc):
            for match in re.finditer(r"\bpdserve serve\b", text):
                rest = text[match.start() :]
                end = _COMMAND_END.search(rest)
                commands.append(shlex.split(rest[: end.start() if end else None])[1:])
    return commands


@pytest.mark.parametrize("path", DEPLOY_FILES, ids=lambda p: p.name)
def test_serve_command_parses_with_the_real_cli(path: Path) -> None:
    commands = serve_commands(path)
    assert commands, f"no `pdserve serve` command in {path.name}"
    for argv in commands:
        ns = build_parser().parse_args(argv)  # exits (fails the test) on any bad flag
        assert ns.command == "serve"
        assert ns.ray_address == "auto"  # joins the cluster the file starts
        assert ns.host == "0.0.0.0" and ns.metrics_host == "0.0.0.0"
        assert ns.prefill_resources == {"prefill_node": 1.0}
        assert ns.decode_resources == {"decode_node": 1.0}
        # The planner sizes the pools; a new worker's placement waits for the autoscaler
        # to bring a node up, which takes minutes.
        assert ns.planner and ns.max_gpus == 4
        check_planner_flags(ns, given_flags(argv))
        assert ns.placement_timeout_s >= 300


def planner_limits(path: Path) -> dict[str, tuple[int, int]]:
    """pool -> (fewest, most) workers the planner in this file's command may run."""
    (argv,) = serve_commands(path)
    ns = build_parser().parse_args(argv)
    return {
        "prefill": (ns.min_prefill, ns.max_gpus - ns.min_decode),
        "decode": (ns.min_decode, ns.max_gpus - ns.min_prefill),
    }


def test_ray_cluster_config_matches_rays_schema_and_offers_the_pool_resources() -> None:
    schema_path = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"
    config = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())
    jsonschema.validate(config, json.loads(schema_path.read_text()))
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    (argv,) = serve_commands(DEPLOY / "ray" / "cluster.yaml")
    ns = build_parser().parse_args(argv)
    limits = planner_limits(DEPLOY / "ray" / "cluster.yaml")
    for pool, requested in (("prefill", ns.prefill_resources), ("decode", ns.decode_resources)):
        offering = [n for n, t in types.items() if set(requested) <= set(t.get("resources", {}))]
        assert len(offering) == 1, f"{requested} should be offered by one node type"
        node_type = types[offering[0]]
        assert node_type["resources"].get("GPU", 0) >= 1
        # The autoscaler may start as many nodes as the planner may ask workers.
        fewest, most = limits[pool]
        assert node_type["min_workers"] >= fewest and node_type["max_workers"] >= most
    assert config["max_workers"] >= sum(most for _, most in limits.values())


def strict(schema: Any) -> Any:
    """The schema with unknown fields refused, as `kubectl apply --validate=strict` does."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def crd_schema(name: str) -> dict[str, Any]:
    # The C loader: the CRD is ~1 MB of YAML (seconds with the pure-Python one).
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((needs_kuberay_reference("crd") / name).read_text(), Loader=loader)
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return strict(v1["schema"]["openAPIV3Schema"])


def rayclusters() -> list[dict[str, Any]]:
    path = DEPLOY / "kuberay" / "raycluster.yaml"
    return [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "RayCluster"]


def start_param_resources(group: dict[str, Any]) -> dict[str, float]:
    # KubeRay passes the value to `ray start --resources`, quoted for the shell.
    text = group.get("rayStartParams", {}).get("resources", '"{}"')
    return json.loads(json.loads(text))


def test_raycluster_manifest_matches_the_kuberay_crd() -> None:
    schema = crd_schema("ray.io_rayclusters.yaml")
    # jsonschema.validate checks the CRD's ~1 MB schema against the metaschema on every
    # call, seconds each: check it once, then report as validate does (the best match).
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    validator = validator_class(schema)

    def validate(document: dict[str, Any]) -> None:
        error = jsonschema.exceptions.best_match(validator.iter_errors(document))
        if error is not None:
            raise error

    (cluster,) = rayclusters()
    assert cluster["apiVersion"] == "ray.io/v1"
    validate(cluster)
    misspelt = json.loads(json.dumps(cluster))
    misspelt["spec"]["workerGroupSpecs"][0]["rayStartParam"] = {}
    with pytest.raises(jsonschema.ValidationError, match="rayStartParam"):
        validate(misspelt)
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    limits = planner_limits(DEPLOY / "kuberay" / "raycluster.yaml")
    for name, group in groups.items():
        assert start_param_resources(group) == {f"{name}_node": 1}
        (container,) = group["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
        fewest, most = limits[name]
        assert fewest <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert group["maxReplicas"] >= most
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert any("pdserve serve" in " ".join(c.get("args", [])) for c in head)


def test_service_and_podmonitor_select_the_head_pod_and_its_ports() -> None:
    (cluster,) = rayclusters()
    name = cluster["metadata"]["name"]
    values = yaml.safe_load((DEPLOY / "kuberay" / "values.yaml").read_text())
    assert values["fullnameOverride"] == name  # the chart names the RayCluster the same
    (argv,) = serve_commands(DEPLOY / "kuberay" / "raycluster.yaml")
    ns = build_parser().parse_args(argv)
    service = yaml.safe_load((DEPLOY / "kuberay" / "service.yaml").read_text())
    # KubeRay labels every pod with its cluster's name and node type.
    assert service["spec"]["selector"] == {"ray.io/cluster": name, "ray.io/node-type": "head"}
    ports = {p["name"]: p["targetPort"] for p in service["spec"]["ports"]}
    assert ports == {"grpc": ns.port, "metrics": ns.metrics_port}
    monitor = yaml.safe_load((DEPLOY / "kuberay" / "podmonitor.yaml").read_text())
    assert monitor["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    head = cluster["spec"]["headGroupSpec"]["template"]
    named_ports = {
        p["name"]: p["containerPort"]
        for c in head["spec"]["containers"]
        for p in c.get("ports", [])
    }
    assert named_ports[monitor["spec"]["podMetricsEndpoints"][0]["port"]] == ns.metrics_port
    assert head["metadata"]["annotations"]["prometheus.io/port"] == str(ns.metrics_port)


# Chart values that are maps or lists of the user's own content (Kubernetes objects,
# labels, `ray start` flags): keys below them are not chart keys.
_FREE_FORM = {"resources", "rayStartParams", "labels", "annotations", "nodeSelector"}


def unknown_keys(
    ours: Any, chart: Any, path: str = "", read: frozenset[str] = frozenset()
) -> list[str]:
    """Keys of `ours` that the chart's values.yaml does not have, and that its templates
    do not read either (`read`: dotted paths like "head.enableInTreeAutoscaling", for
    keys the chart documents only as comments)."""
    if not isinstance(ours, dict) or not isinstance(chart, dict):
        return []
    missing = []
    for key, value in ours.items():
        where = f"{path}.{key}" if path else key
        if path == "additionalWorkerGroups":
            # Group names are the user's; each group takes the keys of the chart's example.
            missing += unknown_keys(value, chart["smallGroup"], where, read)
        elif key not in chart:
            if where not in read:
                missing.append(where)
        elif key not in _FREE_FORM:
            missing += unknown_keys(value, chart[key], where, read)
    return missing


def template_reads(chart_dir: Path) -> frozenset[str]:
    """Every `.Values.a.b` path the chart's templates read."""
    text = "".join(p.read_text() for p in (chart_dir / "templates").glob("*"))
    return frozenset(re.findall(r"\.Values\.([A-Za-z0-9_.]+)", text))


def test_helm_values_use_only_keys_of_the_ray_cluster_chart() -> None:
    chart_dir = needs_kuberay_reference("ray-cluster-chart")
    chart = yaml.safe_load((chart_dir / "values.yaml").read_text())
    ours = yaml.safe_load((DEPLOY / "kuberay" / "values.yaml").read_text())
    read = template_reads(chart_dir)
    assert unknown_keys(ours, chart, read=read) == []
    # Autoscaling: the chart documents its switch only in a comment, and reads it here.
    assert "head.enableInTreeAutoscaling" in read and ours["head"]["enableInTreeAutoscaling"]
    limits = planner_limits(DEPLOY / "kuberay" / "values.yaml")
    for pool, group in (
        ("prefill", ours["worker"]),
        ("decode", ours["additionalWorkerGroups"]["decode"]),
    ):
        fewest, most = limits[pool]
        assert fewest <= group["minReplicas"] and group["maxReplicas"] >= most
    # The same cluster as the manifest: both pools, placed by the same resources.
    assert start_param_resources(ours["worker"]) == {"prefill_node": 1}
    assert ours["worker"]["groupName"] == "prefill"
    assert start_param_resources(ours["additionalWorkerGroups"]["decode"]) == {"decode_node": 1}
    assert ours["additionalWorkerGroups"]["decode"]["disabled"] is False
    # The check itself catches a misspelt key.
    assert unknown_keys({"head": {"rayStartParam": {}}}, chart, read=read) == ["head.rayStartParam"]


# The keys of ghz's JSON config file, as its documentation lists them (ghz.sh/docs/options).
GHZ_CONFIG_KEYS = {
    "proto", "protoset", "call", "import-paths", "cacert", "cert", "key", "cname",
    "skipTLS", "insecure", "authority", "async", "rps", "load-schedule", "load-start",
    "load-end", "load-step", "load-step-duration", "load-max-duration", "concurrency",
    "concurrency-schedule", "concurrency-start", "concurrency-end", "concurrency-step",
    "concurrency-step-duration", "concurrency-max-duration", "total", "timeout",
    "duration", "max-duration", "duration-stop", "data", "data-file", "binary",
    "binary-file", "metadata", "metadata-file", "stream-interval", "stream-call-duration",
    "stream-call-count", "stream-dynamic-messages", "reflect-metadata", "output",
    "format", "skipFirst", "connections", "connect-timeout", "keepalive", "name", "tags",
    "cpus", "debug", "enable-compression", "count-errors", "lb-strategy", "host",
}  # fmt: skip


GHZ_CONFIGS = ("generate-cpu.json", "generate-gpu.json")


def ghz_config(name: str) -> tuple[dict[str, Any], pb.GenerateRequest]:
    config = json.loads((DEPLOY / "ghz" / name).read_text())
    request = pb.GenerateRequest()
    json_format.ParseDict(config["data"], request)  # proto3 JSON names, as ghz sends them
    return config, request


def ghz_seconds(value: str) -> float:
    """A ghz duration ("60s", "5m") in seconds."""
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", value).groups()  # type: ignore[union-attr]
    return float(number) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]


@pytest.mark.parametrize("name", GHZ_CONFIGS)
def test_ghz_config_uses_documented_keys_and_the_real_method(name: str) -> None:
    config, request = ghz_config(name)
    assert set(config) <= GHZ_CONFIG_KEYS, set(config) - GHZ_CONFIG_KEYS
    service, method = config["call"].rsplit(".", 1)
    assert pb.DESCRIPTOR.services_by_name[service.split(".")[-1]].methods_by_name[method]
    assert request.sampling.max_tokens > 0 and request.sampling.ignore_eos
    assert config["concurrency"] <= config["total"]


# A CPU service on the embedded model generates 20-35 tokens/s in all (2 cores); its
# config must finish well inside its own limits at the slow end.
CPU_TOKENS_PER_S = 20.0


def test_ghz_cpu_config_fits_a_cpu_service() -> None:
    config, request = ghz_config("generate-cpu.json")
    tokens = request.sampling.max_tokens
    run_s = config["total"] * tokens / CPU_TOKENS_PER_S
    assert run_s <= ghz_seconds(config["max-duration"]) / 2, run_s
    # A call shares the service with concurrency - 1 others for its whole stream.
    call_s = config["concurrency"] * tokens / CPU_TOKENS_PER_S
    assert call_s <= ghz_seconds(config["timeout"]) / 4, call_s
    # The GPU config asks for more of everything.
    gpu, gpu_request = ghz_config("generate-gpu.json")
    assert gpu["total"] > config["total"] and gpu["concurrency"] > config["concurrency"]
    assert gpu_request.sampling.max_tokens > tokens
