"""Checks across `pdserve`'s flags: combinations that cannot all apply, flags that mean
nothing in a mode, and a --model folder pdserve cannot run. Each raises ValueError with
one line naming the flags; the CLI reports it as a usage error before anything starts."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from engine.model.model_spec import check_architecture
from engine.parallel.tp_heads import tp_size_problem
from engine.wire import POOLS
from router.cli.engine_flags import add_engine_args, add_model_args
from router.fleet import port_holds


def given_flags(argv: Sequence[str]) -> set[str]:
    """The options written on the command line (abbreviations are off, so names are exact)."""
    flags = set()
    for token in argv:
        if token == "--":
            break
        if token.startswith("--"):
            flags.add(token.split("=", 1)[0])
    return flags


def option_strings(adders: Iterable[Callable[[argparse.ArgumentParser], object]]) -> set[str]:
    """Every option name that these `add_*` functions define."""
    probe = argparse.ArgumentParser(add_help=False)
    for add in adders:
        add(probe)
    return {opt for action in probe._actions for opt in action.option_strings}


def check_model_folder(model: str | None, flag: str = "--model") -> None:
    """--model (or `flag`) must be a folder with a config.json of an architecture
    pdserve runs."""
    if model is None:
        return
    config_path = Path(model) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{flag} {model}: no config.json in that folder")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{flag} {model}: config.json is unreadable: {exc}") from None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if architectures:  # without it the engine maps model_type, and says so if it cannot
        try:
            check_architecture(str(architectures[0]))
        except ValueError as exc:
            raise ValueError(f"{flag} {model}: {exc}") from None


def _config_json(folder: Path) -> dict[str, object] | None:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return config if isinstance(config, dict) else None


def check_speculative_config(ns: argparse.Namespace) -> None:
    """A draft model must be a model pdserve runs, with the target's vocabulary (compared
    here when both configs can be read; the engine checks again as it loads)."""
    spec = ns.speculative_config
    if spec is None or spec.model is None:
        return
    check_model_folder(spec.model, "--speculative-config: draft model")
    from engine.model.embedded import EMBEDDED_MODEL_NAME, default_cache_dir

    target = Path(ns.model) if ns.model else default_cache_dir() / EMBEDDED_MODEL_NAME
    draft_config, target_config = _config_json(Path(spec.model)), _config_json(target)
    if draft_config is None or target_config is None:
        return
    vocab, target_vocab = draft_config.get("vocab_size"), target_config.get("vocab_size")
    if vocab != target_vocab:
        raise ValueError(
            f"--speculative-config: draft model {spec.model} has a vocabulary of {vocab} "
            f"tokens, the target {target_vocab}: a draft must share the target's tokenizer"
        )


def check_device_visible(device: str) -> None:
    """--device cuda[:N] needs a CUDA device this torch can use; checked last, as it
    imports torch (about a second), still before anything starts."""
    if not device.startswith("cuda"):
        return
    import torch

    if torch.version.cuda is None:
        raise ValueError(
            f"--device {device}: this torch ({torch.__version__}) is built without CUDA"
        )
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is visible")


def check_serve_flags(ns: argparse.Namespace, given: set[str]) -> None:
    """Refuse values and combinations that cannot all apply; raises ValueError."""
    if ns.colocated_workers:
        pool_only = sorted(
            f
            for f in given
            if f.startswith("--prefill-")
            or f
            in (
                "--decode-workers",
                "--decode-resources",
                "--local-prefill-max-tokens",
                "--slo-ttft-ms",
                "--slo-tpot-ms",
            )
        )
        if pool_only:
            raise ValueError(
                f"{', '.join(pool_only)} and --colocated-workers cannot both apply: colocated "
                "replicas replace both pools and take the --decode-* knobs"
            )
    else:
        for flag in ("--colocated-resources", "--colocated-tensor-parallel-size"):
            if flag in given:
                raise ValueError(f"{flag} applies only with --colocated-workers N")
    check_planner_flags(ns, given)
    if ns.metrics_port:
        problem = port_holds.check(ns.metrics_host, ns.metrics_port)
        if problem is not None:
            raise ValueError(f"--metrics-port {ns.metrics_port}: {problem}")
    if ns.metrics_port == 0 and "--metrics-host" in given:
        raise ValueError("--metrics-host and --metrics-port 0 (metrics off) cannot both apply")
    if ns.metrics_port and ns.metrics_port == ns.port:
        raise ValueError(f"--port and --metrics-port are both {ns.port}")
    check_router_tier(ns)
    check_model_folder(ns.model)
    check_speculative_config(ns)
    check_tensor_parallel(ns)
    if not ns.ray_address:  # a cluster's GPUs are on its nodes, not necessarily here
        check_device_visible(ns.device)


def check_router_tier(ns: argparse.Namespace) -> None:
    """Several router processes call the workers over their own connections, each with
    its metrics on a port of its own (the metrics port plus its index)."""
    n = ns.router_processes
    if n == 1:
        return
    if ns.worker_calls == "ray":
        raise ValueError(
            "--router-processes above 1 needs --worker-calls direct: the other router "
            "processes call the workers over connections of their own, not through Ray"
        )
    if ns.metrics_port:
        last = ns.metrics_port + n - 1
        if last > 65535:
            raise ValueError(
                f"--metrics-port {ns.metrics_port} and --router-processes {n}: the router "
                f"processes' metrics ports would reach {last}"
            )
        if ns.metrics_port <= ns.port <= last:
            raise ValueError(
                f"--port {ns.port} is among the metrics ports of --router-processes {n} "
                f"({ns.metrics_port}-{last})"
            )
        for port in range(ns.metrics_port + 1, last + 1):
            problem = port_holds.check(ns.metrics_host, port)
            if problem is not None:
                raise ValueError(f"--router-processes {n}: metrics port {port}: {problem}")


def check_tensor_parallel(ns: argparse.Namespace) -> None:
    """Each pool's TP size must split the model's heads."""
    from router.cli.engine_flags import tensor_parallel_size

    pools = ("colocated",) if ns.colocated_workers else ("prefill", "decode")
    sizes = {pool: tensor_parallel_size(ns, pool) for pool in pools}
    if all(size == 1 for size in sizes.values()):
        return
    if getattr(ns, "planner", False):
        raise ValueError(
            "--planner sizes one-GPU workers: it cannot apply with a tensor-parallel size above 1"
        )
    folder = Path(ns.model) if ns.model else _embedded_folder()
    config = _config_json(folder) if folder is not None else None
    if config is None:
        return  # the worker refuses it at start-up, naming the numbers the same way
    num_q = int(str(config.get("num_attention_heads", 0)))
    num_kv = int(str(config.get("num_key_value_heads") or num_q))
    for pool, size in sizes.items():
        problem = tp_size_problem(num_q, num_kv, size)
        if problem:
            raise ValueError(f"--{pool}-tensor-parallel-size / -tp: {problem}")


def _embedded_folder() -> Path | None:
    """The embedded model's folder when it has been converted (its heads: 9 and 3)."""
    from engine.model.embedded import EMBEDDED_MODEL_NAME, default_cache_dir

    folder = default_cache_dir() / EMBEDDED_MODEL_NAME
    return folder if (folder / "config.json").is_file() else None


PLANNER_ONLY = (
    "--max-gpus",
    "--min-prefill",
    "--min-decode",
    "--planner-interval-s",
    "--planner-cooldown-s",
)


def check_planner_flags(ns: argparse.Namespace, given: set[str]) -> None:
    """The planner's flags need --planner, and the pools must start within its bounds."""
    if not ns.planner:
        stray = sorted(given & set(PLANNER_ONLY))
        if stray:
            raise ValueError(f"{', '.join(stray)} applies only with --planner")
        return
    if ns.colocated_workers:
        raise ValueError(
            "--planner and --colocated-workers cannot both apply: the planner sizes the "
            "prefill and decode pools"
        )
    if ns.max_gpus is None:
        raise ValueError("--planner needs --max-gpus N: the most workers both pools may hold")
    if ns.min_prefill + ns.min_decode > ns.max_gpus:
        raise ValueError(
            f"--planner: --min-prefill {ns.min_prefill} and --min-decode {ns.min_decode} "
            f"exceed --max-gpus {ns.max_gpus}"
        )
    for pool in ("prefill", "decode"):
        start, low = getattr(ns, f"{pool}_workers"), getattr(ns, f"min_{pool}")
        if start < low:
            raise ValueError(f"--planner: --{pool}-workers {start} is below --min-{pool} {low}")
    if ns.prefill_workers + ns.decode_workers > ns.max_gpus:
        raise ValueError(
            f"--planner: --prefill-workers {ns.prefill_workers} and --decode-workers "
            f"{ns.decode_workers} exceed --max-gpus {ns.max_gpus}"
        )


def check_generate_flags(ns: argparse.Namespace, given: set[str]) -> None:
    """Refuse flags that do not apply: engine flags with --server, client flags offline."""
    if ns.server:
        wrong = sorted(given & option_strings([add_model_args, add_engine_args]))
        if wrong:
            raise ValueError(
                f"{', '.join(wrong)}: only for offline generation (without --server); "
                "a server's model and engine are set by `pdserve serve`"
            )
        return
    from router.cli.client import add_security_arguments

    client_only = {"--timeout", "--request-id"} | option_strings([add_security_arguments])
    wrong = sorted(given & client_only)
    if wrong:
        raise ValueError(
            f"{', '.join(wrong)}: only with --server (offline generation is in-process)"
        )
    check_model_folder(ns.model)
    check_speculative_config(ns)
    check_device_visible(ns.device)


def check_scale_flags(ns: argparse.Namespace) -> None:
    """`pdserve scale` needs something to do."""
    if all(getattr(ns, pool) is None for pool in POOLS) and not (ns.drain or ns.migrate):
        raise ValueError("give --prefill, --decode, --colocated, --drain or --migrate")
    if ns.max_requests is not None and not ns.migrate:
        raise ValueError("--max-requests: only with --migrate")
