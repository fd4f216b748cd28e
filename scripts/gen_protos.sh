#!/usr/bin/env bash
# Regenerates the committed Python stubs under protos/pdserve/v1/.
#
# Pinned to grpcio-tools 1.84.0 because the stubs must import on the GPU image
# (grpcio 1.84.0, protobuf 7.36.x): gencode from newer tools can demand a newer
# runtime than that image has. The tools live in their own venv so the project
# venv's grpcio-tools version does not matter.
#
#   scripts/gen_protos.sh            # bootstrap tools venv if needed, regenerate
#   GEN_PYTHON=/path/bin/python scripts/gen_protos.sh   # use an existing venv
set -euo pipefail

TOOLS_VERSION=1.84.0
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS_VENV="${GEN_TOOLS_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/pdserve-grpcio-tools-${TOOLS_VERSION}}"
PY="${GEN_PYTHON:-$TOOLS_VENV/bin/python}"

if [[ -z "${GEN_PYTHON:-}" && ! -x "$PY" ]]; then
  python3 -m venv "$TOOLS_VENV"
  "$TOOLS_VENV/bin/pip" install --quiet "grpcio-tools==${TOOLS_VERSION}"
fi

have="$("$PY" -c 'from importlib.metadata import version; print(version("grpcio-tools"))')"
if [[ "$have" != "$TOOLS_VERSION" ]]; then
  echo "gen_protos: $PY has grpcio-tools $have, need $TOOLS_VERSION" >&2
  exit 1
fi

cd "$ROOT/protos"
# Paths relative to protos/ so the generated imports read `from pdserve.v1 import ...`.
"$PY" -m grpc_tools.protoc \
  -I . \
  --python_out=. \
  --pyi_out=. \
  --grpc_python_out=. \
  pdserve/v1/generation.proto \
  pdserve/v1/admin.proto
echo "gen_protos: regenerated protos/pdserve/v1 with grpcio-tools $have"
