"""`pdserve` command line: usage per subcommand, defaults in help, clear errors before work."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from bench.harness import REPO, service_env
from engine.core.request import FinishReason
from engine.model.model_loader import load_tokenizer
from router.cli.commands import sampling_params
from router.cli.engine_flags import engine_args
from router.cli.main import build_parser, main
from router.edge.grpc_server import GrpcServer
from tests.fake_core import FakeCore, run_with_server


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run `pdserve argv` in-process; it must exit 2 (usage error) with one line on stderr,
    which is returned."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_unknown_flag_is_one_line_naming_the_subcommand(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = _fails(["serve", "--bogus"], capsys)
    assert err.startswith("pdserve serve: error: unrecognized arguments: --bogus")
    assert "pdserve serve --help" in err
    err = _fails(["generate", "hi", "--bogus", "1"], capsys)
    assert err.startswith("pdserve generate: error:") and "--bogus" in err


def test_abbreviated_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # Abbreviations would silently change meaning as flags are added.
    assert "unrecognized arguments: --prefill-work" in _fails(
        ["serve", "--prefill-work", "2"], capsys
    )


def test_log_level_before_or_after_the_subcommand() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).log_level == "INFO"
    assert parser.parse_args(["--log-level", "debug", "serve"]).log_level == "DEBUG"
    assert parser.parse_args(["serve", "--log-level", "warning"]).log_level == "WARNING"
    assert parser.parse_args(["generate", "x", "--log-level", "error"]).log_level == "ERROR"


def test_bad_log_level_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--log-level" in _fails(["serve", "--log-level", "loud"], capsys)


def test_stream_interval_is_auto_unless_a_number_is_given() -> None:
    from router.cli.flags import router_config

    parser = build_parser()
    assert router_config(parser.parse_args(["serve"])).stream_interval == "auto"
    for value, expected in (("4", 4), ("auto", "auto")):
        ns = parser.parse_args(["serve", "--stream-interval", value])
        assert router_config(ns).stream_interval == expected


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_flag_help_gives_its_default(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    # One entry per option: a line starting with "  -", plus its indented continuation.
    entries = re.split(r"\n(?=  -)", text.split("options:", 1)[1])
    flags = [e for e in entries if e.lstrip().startswith("--")]
    assert len(flags) > 10
    missing = [e.split()[0] for e in flags if "default" not in e]
    assert missing == []
    if command == "generate":
        assert re.search(
            r"--max-tokens MAX_TOKENS\s+tokens to generate at most \(default: 256\)", text
        )


def test_server_without_port_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = _fails(["generate", "--server", "127.0.0.1", "hi"], capsys)
    assert "expected HOST:PORT" in err
    assert "port must be 1-65535" in _fails(["generate", "--server", "h:70000", "hi"], capsys)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--server", "127.0.0.1:50051", "--model", "/x"], "--model: only for offline"),
        (["--server", "127.0.0.1:50051", "--prefill-policy", "fcfs"], "unrecognized"),
        (["--server", "127.0.0.1:50051", "--max-num-seqs", "4"], "--max-num-seqs: only for"),
        (["--timeout", "3"], "--timeout: only with --server"),
        (["--request-id", "r1"], "--request-id: only with --server"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--device", "tpu"], "expected auto, cpu, cuda or cuda:N"),
        (["--max-num-seqs", "0"], "--max-num-seqs: must be >= 1, got 0"),
        (["--kv-cache-gib", "0"], "--kv-cache-gib: must be > 0"),
    ],
)
def test_inapplicable_or_bad_generate_flags_fail_before_any_work(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    start = time.monotonic()
    err = _fails(["generate", "hi", *argv], capsys)
    assert message in err and "Traceback" not in err
    assert time.monotonic() - start < 5  # refused before a model loads


def test_missing_model_folder_fails_before_loading(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _fails(["generate", "hi", "--model", str(tmp_path)], capsys)
    assert "no config.json" in err


def test_unsupported_model_folder_fails_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    for argv in (["generate", "hi"], ["serve"]):
        err = _fails([*argv, "--model", str(tmp_path)], capsys)
        assert "unsupported model architecture 'GPT2LMHeadModel'" in err
        assert "LlamaForCausalLM" in err  # what is supported


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--port", "99999"], "argument --port: must be 0-65535, got 99999"),
        (["serve", "--metrics-port", "-1"], "argument --metrics-port: must be >= 0, got -1"),
        (["serve", "--max-in-flight", "0"], "argument --max-in-flight: must be >= 1, got 0"),
        (["serve", "--max-queue", "-1"], "argument --max-queue: must be >= 0"),
        (["serve", "--prefill-workers", "0"], "argument --prefill-workers: must be >= 1"),
        (["serve", "--decode-max-num-seqs", "x"], "--decode-max-num-seqs: expected an integer"),
        (["serve", "--drain-grace-s", "-2"], "argument --drain-grace-s: must be >= 0"),
        (["serve", "--stream-interval", "0"], "argument --stream-interval: must be >= 1"),
        (["serve", "--stream-interval", "fast"], "--stream-interval: expected an integer"),
        (["serve", "--kv-stream-min-tokens", "-1"], "--kv-stream-min-tokens: must be >= 0"),
        (["serve", "--decode-gpu-memory-utilization", "1.5"], "must be > 0 and <= 1, got 1.5"),
        (["serve", "--port", "9400"], "--port and --metrics-port are both 9400"),
        (["serve", "--tls-cert", "x.pem"], "--tls-cert and --tls-key must be given together"),
        (["scale", "--server", "127.0.0.1:1", "--prefill", "-1"], "--prefill: must be >= 0"),
        (
            ["scale", "--server", "127.0.0.1:1"],
            "give --prefill, --decode, --colocated, --drain or --migrate",
        ),
        (
            ["scale", "--server", "127.0.0.1:1", "--decode", "2", "--max-requests", "2"],
            "--max-requests: only with --migrate",
        ),
        (["workers", "--server", "127.0.0.1:1", "--auth-token-file", "/no/such"], "no such file"),
    ],
)
def test_bad_values_are_one_line_usage_errors_before_anything_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    start = time.monotonic()
    err = _fails(argv, capsys)
    assert err.startswith(f"pdserve {argv[0]}: error: ") and message in err
    assert time.monotonic() - start < 5  # no Ray, no model, no network call


@pytest.mark.parametrize(
    ("argv", "flags"),
    [
        (["--colocated-workers", "2", "--prefill-workers", "2"], "--prefill-workers"),
        (["--colocated-workers", "2", "--decode-workers", "3"], "--decode-workers"),
        (["--colocated-workers", "1", "--prefill-max-num-seqs", "8"], "--prefill-max-num-seqs"),
        (["--colocated-workers", "1", "--local-prefill-max-tokens", "0"], "--local-prefill-max"),
        (["--colocated-resources", '{"gpu_node": 1}'], "--colocated-resources"),
        (["--metrics-port", "0", "--metrics-host", "0.0.0.0"], "--metrics-host"),
        (["--max-gpus", "4"], "--max-gpus applies only with --planner"),
        (["--planner-interval-s", "2"], "--planner-interval-s applies only with --planner"),
        (["--planner", "--colocated-workers", "2", "--max-gpus", "4"], "--colocated-workers"),
        (["--planner"], "--planner needs --max-gpus N"),
        (["--planner", "--max-gpus", "3", "--min-decode", "3"], "exceed --max-gpus 3"),
        (["--planner", "--max-gpus", "4", "--min-prefill", "2"], "--prefill-workers 1 is below"),
        (["--planner", "--max-gpus", "3", "--decode-workers", "3"], "--decode-workers 3"),
        (["--router-processes", "2", "--worker-calls", "ray"], "--worker-calls direct"),
        (["--router-processes", "3", "--port", "9401", "--metrics-port", "9400"], "--port"),
    ],
)
def test_flags_that_cannot_both_apply_are_refused_naming_both(
    argv: list[str], flags: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _fails(["serve", *argv], capsys)
    assert flags in err and argv[0] in err


@pytest.mark.parametrize(
    ("finish", "error", "shown"),
    [
        (FinishReason.ABORT, "server is draining; grace period over", "finish=abort"),
        (FinishReason.ERROR, "decode worker 0 died", "finish=error"),
    ],
)
def test_generate_from_a_server_reports_an_abort_or_error_and_fails(
    finish: FinishReason, error: str, shown: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rcs = []

    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        rcs.append(
            await asyncio.get_running_loop().run_in_executor(
                None, main, ["generate", "--server", server.address, "hi"]
            )
        )

    run_with_server(FakeCore(finish=finish, error=error), body)
    out, err = capsys.readouterr()
    assert rcs == [1]
    assert out.startswith("t0 t1 t2")  # the text that did arrive is kept
    (line,) = err.strip().splitlines()
    assert shown in line and line.endswith(f"error: {error}")
    assert "ttft=" not in line and "prompt=" not in line


def test_generate_from_a_server_that_completes_exits_0(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rcs = []

    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        rcs.append(
            await asyncio.get_running_loop().run_in_executor(
                None, main, ["generate", "--server", server.address, "hi"]
            )
        )

    run_with_server(FakeCore(finish=FinishReason.STOP), body)
    assert rcs == [0]
    assert "finish=stop prompt=" in capsys.readouterr().err


def test_generate_defaults_are_the_same_offline_and_served() -> None:
    """The request the CLI sends carries exactly the sampling the offline path uses."""
    ns = build_parser().parse_args(["generate", "hi"])
    offline = sampling_params(ns)
    assert (offline.max_tokens, offline.temperature) == (256, 0.0)

    async def body(server: GrpcServer, channel: grpc.aio.Channel, core: FakeCore) -> None:
        rc = await asyncio.get_running_loop().run_in_executor(
            None, main, ["generate", "--server", server.address, "hi"]
        )
        assert rc == 0

    core = FakeCore()
    run_with_server(core, body)
    assert core.calls[0].sampling == offline


def _one_line_failure(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_port_in_use_is_one_line_and_nonzero_exit() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "router.cli.main", "serve", "--port", str(port)],
            cwd=REPO,
            env=service_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert _one_line_failure(proc) == f"pdserve: startup failed: 127.0.0.1:{port} is in use"
    assert proc.returncode == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--port", "99999"], "argument --port: must be 0-65535, got 99999"),
        (["serve", "--colocated-workers", "2", "--prefill-workers", "2"], "cannot both apply"),
        (["scale", "--server", "127.0.0.1:1", "--decode", "0"], "size must be between 1 and"),
        (["generate", "--server", "127.0.0.1:1", "--block-size", "8", "hi"], "--block-size"),
    ],
)
def test_a_usage_error_is_refused_at_once_by_the_installed_command(
    argv: list[str], message: str
) -> None:
    # The whole command as a user runs it, interpreter start included: parsing and
    # checking come before torch, Ray or transformers are imported (seconds each).
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "router.cli.main", *argv],
        cwd=REPO,
        env=service_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.monotonic() - start
    line = _one_line_failure(proc)
    assert proc.returncode == 2 and message in line, line
    assert elapsed < 1.5, f"a usage error took {elapsed:.2f} s"


def test_checking_flags_imports_no_torch_ray_or_transformers() -> None:
    code = (
        "import sys\n"
        "from router.cli.main import main\n"
        "try:\n"
        "    main(['serve', '--port', '99999'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=service_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_scale_to_zero_is_refused_by_the_rule_the_server_applies(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from router.fleet.pool_sizes import MAX_POOL_SIZE, pool_size_problem

    for size in (0, MAX_POOL_SIZE + 1):
        err = _fails(["scale", "--server", "127.0.0.1:1", "--decode", str(size)], capsys)
        assert f"argument --decode: {pool_size_problem(size)}" in err
    assert pool_size_problem(1) is None and pool_size_problem(MAX_POOL_SIZE) is None


@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["generate", "hi"]])
def test_cuda_without_a_usable_cuda_is_refused_before_anything_starts(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible here")
    start = time.monotonic()
    err = _fails([*command, "--device", "cuda"], capsys)
    assert "--device cuda: " in err and ("without CUDA" in err or "no CUDA device" in err)
    assert time.monotonic() - start < 5  # no Ray, no weights


def test_busy_metrics_port_fails_before_ray_starts() -> None:
    # Colocated replicas with decode knobs: accepted, so start-up gets as far as the ports.
    flags = ["--colocated-workers", "2", "--decode-max-num-seqs", "8", "--port", "0"]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "router.cli.main", "serve", *flags, "--metrics-port", str(port)],
            cwd=REPO,
            env=service_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
    line = _one_line_failure(proc)
    assert f"--metrics-port {port}: 127.0.0.1:{port} is in use" in line, line
    assert proc.returncode == 2


def test_offline_generate_prints_no_progress_bars_and_ends_with_counts_and_times(
    capfd: pytest.CaptureFixture[str], smollm2_path: Path
) -> None:
    assert main(["generate", "hi", "--max-tokens", "2", "--kv-cache-gib", "0.05"]) == 0
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "\r" not in err
    # The same summary as against a server, less the request id a server assigns.
    prompt_tokens = len(load_tokenizer(smollm2_path).encode("hi"))
    assert re.fullmatch(
        rf"finish=length prompt={prompt_tokens} completion=2 cached=0 "
        r"ttft=\d+\.\d{3}s total=\d+\.\d{3}s",
        err.strip().splitlines()[-1],
    )


def test_offline_generate_refuses_an_over_long_prompt_in_one_line(
    capfd: pytest.CaptureFixture[str],
) -> None:
    argv = ["generate", "hello " * 9001, "--max-tokens", "4", "--kv-cache-gib", "0.05"]
    assert main(argv) == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err and "sequence length is longer" not in err
    assert err.strip().splitlines()[-1] == (
        "pdserve generate: prompt (9002 tokens) + max_tokens (4) = 9006 exceeds the model's "
        "context length 8192"
    )


@pytest.mark.parametrize("preset", [None, "token"])
def test_serve_starts_its_local_ray_without_token_auth_unless_told(
    preset: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ray 2.60 turns token auth on for a new local instance, with a warning in the log,
    # unless RAY_AUTH_MODE is set; the instance serve starts listens on loopback only.
    for name in ("RAY_AUTH_MODE", "RAY_ADDRESS", "RAY_COLOR_PREFIX"):
        monkeypatch.delenv(name, raising=False)
    if preset:
        monkeypatch.setenv("RAY_AUTH_MODE", preset)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 1  # stops before Ray starts
    assert os.environ["RAY_AUTH_MODE"] == (preset or "disabled")
    assert os.environ["RAY_COLOR_PREFIX"] == "0"  # stderr is captured: no colour codes


def test_ctrl_c_in_the_client_exits_quietly() -> None:
    # A server that accepts connections but never answers: the call waits until Ctrl-C.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        target = f"127.0.0.1:{silent.getsockname()[1]}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli.main", "generate", "--server", target, "hi"],
            cwd=REPO,
            env=service_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # A job started in the background by a shell inherits SIGINT ignored, and so
            # would the client: Ctrl-C must reach it as it does from a terminal.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        silent.settimeout(30)
        conn, _ = silent.accept()  # the client is up and waiting for an answer
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        conn.close()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err


def test_no_async_scheduling_turns_the_step_ahead_loop_off() -> None:
    parser = build_parser()
    assert engine_args(parser.parse_args(["generate", "x"])).async_scheduling is None  # auto
    off = parser.parse_args(["generate", "x", "--no-async-scheduling"])
    assert engine_args(off).async_scheduling is False
    serve = parser.parse_args(["serve", "--no-async-scheduling"])
    assert engine_args(serve, "decode").async_scheduling is False


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # The embedded model: 9 attention heads, 3 KV heads.
        (["-tp", "2"], "tensor parallel size 2 does not divide the model's 9 attention heads"),
        (["--decode-tensor-parallel-size", "6"], "--decode-tensor-parallel-size / -tp: tensor"),
        (["--colocated-tensor-parallel-size", "3"], "applies only with --colocated-workers"),
        (["--tensor-parallel-size", "3", "--planner", "--max-gpus", "8"], "one-GPU workers"),
    ],
)
def test_tensor_parallel_sizes_that_cannot_split_the_model_are_refused_before_starting(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], smollm2_path: Path
) -> None:
    start = time.monotonic()
    err = _fails(["serve", *argv], capsys)
    assert message in err, err
    assert time.monotonic() - start < 5  # no Ray, no model
