#!/usr/bin/env bash
# The GPU run: install any wheels found in .whl/, keep NVLink multicast off, run the CUDA
# tests, then the benchmark suite. Everything it writes goes under $OUT
# (default bench/results/gpu-run).
#
#   bench/run_gpu.sh [all|tests|suite] [bench.gpu_suite arguments...]
#   bench/run_gpu.sh tests [pytest paths...]     # default: every module under tests/
#
# e.g. `bench/run_gpu.sh all --quick` (smoke) or `bench/run_gpu.sh suite --shapes 8b`.
# One command fits 10 minutes; the suite's parts can be spread over several, e.g.
#   bench/run_gpu.sh suite --shapes 1b --parts b,cc,c --rounds 4
# and `python -m bench.suite_report A.json B.json` prints their tables,
# `python -m bench.plots A.json B.json --out docs/img` draws them.
# The suite gets --time-budget = RUN_GPU_DEADLINE_S (default 570) minus the seconds already
# spent, so a run under a wall-clock limit still ends with its JSON written; a later
# --time-budget among the arguments wins.
set -uo pipefail
what=${1:-all}
shift || true
OUT=${OUT:-$PWD/bench/results/gpu-run}
mkdir -p "$OUT"

source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"

nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || true
rc=0
if [[ $what == all || $what == tests ]]; then
  # Every test marked gpu, in any module; a module that cannot be imported there (a
  # package the image lacks) is reported without stopping the others.
  # The whole set takes about 7 minutes on 2 GPUs (the service tests start real
  # services): under a 10-minute call, run it in two calls by module if need be.
  targets=("$@")
  [[ $what == tests && ${#targets[@]} -gt 0 ]] || targets=(tests)
  timeout $(( ${RUN_GPU_DEADLINE_S:-570} - 20 )) python3 -m pytest -m gpu "${targets[@]}" -v -rs \
    -p no:cacheprovider --durations=15 --continue-on-collection-errors \
    --basetemp=/tmp/pdserve-pytest-gpu 2>&1 | tee "$OUT/pytest_gpu.log"
  rc=${PIPESTATUS[0]}
fi
if [[ $what == all || $what == suite ]]; then
  budget=$(( ${RUN_GPU_DEADLINE_S:-570} - SECONDS ))
  python3 -m bench.gpu_suite --workdir /tmp/pdserve-gpu-suite --out "$OUT/gpu_suite.json" \
    --time-budget "$budget" "$@" 2>&1 | tee "$OUT/gpu_suite.log"
  suite_rc=${PIPESTATUS[0]}
  [[ $rc == 0 ]] && rc=$suite_rc
fi
# Service and worker logs, for whoever reads a failure.
tar czf "$OUT/logs.tgz" -C /tmp $(cd /tmp && ls -d pdserve-gpu-suite pdserve-pytest-gpu 2>/dev/null) \
  2>/dev/null || true
exit "$rc"
