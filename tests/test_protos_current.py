"""The committed stubs under protos/pdserve/v1 match generation.proto."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from pdserve.v1 import generation_pb2

ROOT = Path(__file__).resolve().parents[1]
PROTOS = ROOT / "protos"
PROTO = "pdserve/v1/generation.proto"
STUBS = ("generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py")
PINNED_TOOLS = "1.84.0"  # keep in step with scripts/gen_protos.sh


def _protoc(python: str, *args: str) -> None:
    subprocess.run(
        [python, "-m", "grpc_tools.protoc", "-I", str(PROTOS), *args, PROTO],
        check=True,
        capture_output=True,
        text=True,
    )


def _strip_json_names(messages: Iterable[descriptor_pb2.DescriptorProto]) -> None:
    # --descriptor_set_out fills json_name; the descriptor embedded in _pb2 leaves it unset.
    for message in messages:
        for field in (*message.field, *message.extension):
            field.ClearField("json_name")
        _strip_json_names(message.nested_type)


def test_committed_descriptor_matches_proto(tmp_path: Path) -> None:
    """Works with any grpcio-tools: compares descriptors, not generated text."""
    pytest.importorskip("grpc_tools", reason="grpcio-tools is not installed")
    out = tmp_path / "generation.binpb"
    _protoc(sys.executable, f"--descriptor_set_out={out}")
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    _strip_json_names(fresh.message_type)
    committed = descriptor_pb2.FileDescriptorProto.FromString(
        generation_pb2.DESCRIPTOR.serialized_pb
    )
    assert committed == fresh, "stubs are stale: run scripts/gen_protos.sh and commit the result"


def _tools_version(python: str) -> str | None:
    probe = "from importlib.metadata import version; print(version('grpcio-tools'))"
    result = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else None


def test_committed_stubs_are_byte_identical(tmp_path: Path) -> None:
    """Exact regeneration with the pinned tools (PDSERVE_GEN_PYTHON may point at their venv)."""
    python = os.environ.get("PDSERVE_GEN_PYTHON", sys.executable)
    have = _tools_version(python)
    if have != PINNED_TOOLS:
        pytest.skip(
            f"needs grpcio-tools=={PINNED_TOOLS} (found {have} in {python}); "
            "set PDSERVE_GEN_PYTHON to a python that has it"
        )
    _protoc(
        python, f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}"
    )
    for name in STUBS:
        fresh = (tmp_path / "pdserve" / "v1" / name).read_text()
        committed = (PROTOS / "pdserve" / "v1" / name).read_text()
        assert committed == fresh, f"{name} is stale: run scripts/gen_protos.sh"
