#!/usr/bin/env bash
# Engine speed on one GPU, everything in one run so ratios compare like with like:
# the one-GPU CUDA tests of the runner and its kernels, the decode step against the memory floor
# (decoder compiled and not, with a kernel-class profile), prefill against the card's GEMM
# rate, and the engine (compiled and not) against transformers generate() at concurrency
# 128. With BASE=<folder holding an older engine/ and bench/>, that tree's decode step and
# engine run too, on the same card, as the "before" numbers. PARTS picks the pieces.
#
#   OUT=/tmp/out PARTS="tests decode prefill engine" bash bench/engine_speed_gpu.sh
set -uo pipefail
OUT=${OUT:-$PWD/bench/results/engine-speed}
PARTS=${PARTS:-tests decode prefill engine}
mkdir -p "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
ROOT=$PWD
want() { [[ " $PARTS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader \
  | tee "$OUT/gpu.txt"
git rev-parse HEAD >>"$OUT/gpu.txt" 2>/dev/null || true

want tests && timeout "${TESTS_S:-240}" python3 -m pytest -m gpu tests/test_triton_prefill.py \
  tests/test_gpu_runner.py -v -rs -p no:cacheprovider \
  --basetemp=/tmp/pdserve-pytest-gpu 2>&1 | tee "$OUT/pytest_gpu.log" | tail -30
want decode && timeout "${DECODE_S:-400}" python3 -m bench.decode_step --batch-sizes 1,128 \
  --contexts 2048 --steps 15 --compile on,off \
  --profile llama-3.2-1b:1:2048,llama-3.2-1b:128:2048,llama-3.1-8b:1:2048 \
  --out "$OUT/decode_step.json" 2>&1 | tail -14
want prefill && timeout 100 python3 -m bench.prefill --out "$OUT/prefill.json" 2>&1 | tail -20
want engine && timeout "${ENGINE_S:-300}" python3 -m bench.suite_offline --shape 1b \
  --model deploy/model_configs/llama-3.2-1b --parts floor,b,b0,a --concurrency 128 \
  --out "$OUT/suite_1b.json" 2>&1 | tail -8
if [[ -n ${BASE:-} && -d ${BASE:-} ]]; then
  cd "$BASE" && export PYTHONPATH=$PWD:${PYTHONPATH}
  cp -r "$ROOT/deploy" . 2>/dev/null
  timeout 90 python3 -m bench.decode_step --models llama-3.2-1b --batch-sizes 1,128 \
    --contexts 2048 --steps 15 --out "$OUT/base_decode_step.json" 2>&1 | tail -4
  timeout 120 python3 -m bench.suite_offline --shape 1b --model deploy/model_configs/llama-3.2-1b \
    --parts floor,b --concurrency 128 --out "$OUT/base_suite_1b.json" 2>&1 | tail -4
fi
