#!/usr/bin/env bash
# Two trees of the project, measured in turn in one call on one machine: the GPU suite's
# parts run from each tree's own checkout, alternating, so a ratio between them is read
# inside one run (machines of one kind differ by more than most changes).
#
#   bench/ab_suite.sh BASE NEW [PAIRS] -- [bench.gpu_suite arguments...]
#
# BASE and NEW: a tree each, a directory or a .tgz of one (`git archive REV | gzip >
# base.tgz`: the GPU machines have no git history). PAIRS (default 2): how many times
# each runs, base first. Each run gets what is left of RUN_GPU_DEADLINE_S (default 570)
# divided by the runs still to go, and a run with less than 80 s left is skipped.
# Everything lands in one file, $OUT/ab.tgz (the results JSON and log of each run), and
# each run's throughput lines (and 1P1D hand-offs against alone) print as it ends, e.g.
#
#   bench/ab_suite.sh .gpux/base.tgz .gpux/new.tgz 2 -- --shapes 1b --parts c \
#       --concurrency 128 --rounds 32 --no-burst --ttft-lens ""
set -uo pipefail
base=$1 new=$2
shift 2
pairs=2
if [[ ${1:-} != -- && -n ${1:-} ]]; then pairs=$1; shift; fi
[[ ${1:-} == -- ]] && shift
OUT=${OUT:-$PWD/bench/results/ab}
mkdir -p "$OUT"
here=$PWD
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
rest=${PYTHONPATH#"$here:$here/protos"}  # the wheels' folder and the caller's paths
work=$(mktemp -d /tmp/pdserve-ab.XXXX)

tree_dir() {  # a tree as a directory
  if [[ -d $1 ]]; then (cd "$1" && pwd); return; fi
  local dir=$work/tree-$2
  mkdir -p "$dir" && tar xzf "$1" -C "$dir" && echo "$dir"
}
declare -A trees=([base]=$(tree_dir "$base" base) [new]=$(tree_dir "$new" new))
deadline=${RUN_GPU_DEADLINE_S:-570}
runs=$((2 * pairs))
for ((i = 0; i < runs; i++)); do
  name=$([[ $((i % 2)) == 0 ]] && echo base || echo new)
  tag=$name$((i / 2 + 1))
  left=$((deadline - SECONDS))
  budget=$((left / (runs - i)))
  if ((budget < 80)); then echo "$tag: skipped, $left s left"; continue; fi
  dir=${trees[$name]}
  (cd "$dir" && OUT= PYTHONPATH=$dir:$dir/protos$rest timeout $((budget + 10)) \
    python3 -m bench.gpu_suite --workdir "$work/w-$tag" --out "$work/$tag.json" \
    --time-budget "$budget" "$@" >"$work/$tag.log" 2>&1)
  echo "$tag ($dir) ended at $SECONDS s"
  python3 -m bench.suite_report "$work/$tag.json" 2>/dev/null |
    sed -n '/throughput and latency/,/^$/p;/KV hand-off p50 in the 1P1D/,/^$/p' |
    grep -v '^==\|^shape\|^$' || tail -3 "$work/$tag.log"
done
(cd "$work" && tar czf "$OUT/ab.tgz" ./*.json ./*.log 2>/dev/null)
cd "$here" && ls -la "$OUT"
