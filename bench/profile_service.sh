#!/usr/bin/env bash
# Where a loaded service spends its time: runs a GPU-suite part in the background and
# samples the router and every worker with py-spy while the load runs (one collapsed-stack
# file per process under $OUT, then `python -m bench.stack_report` sums them by function).
#
#   PROFILE_AFTER_S=15 PROFILE_FOR_S=10 bash bench/profile_service.sh \
#       --shapes 1b --parts c --concurrency 128 --rounds 96 --no-burst --ttft-lens ""
#
# PROFILE_AFTER_S: seconds after the service reports SERVING (the suite's warm-up
# requests, then the load's first ramp) before sampling starts; PROFILE_FOR_S: how long
# to sample (the load must last that long: enough --rounds); PROFILE_NATIVE=1 adds native frames
# (C extensions, the event loop's own code) to the stacks, pausing each process to read
# them (--nonblocking cannot read native frames); PROFILE_GIL=1 also records, per process,
# the samples whose thread holds the interpreter's lock (`*-gil.txt`): which thread's work
# the others wait behind. py-spy comes from .whl/ like the other packages the GPU image
# lacks.
set -uo pipefail
OUT=${OUT:-$PWD/bench/results/profile}
mkdir -p "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
pyspy=$(command -v py-spy || echo /tmp/site/bin/py-spy)
how=--nonblocking
[[ -n ${PROFILE_NATIVE:-} ]] && how=--native

# The suite's service logs (run_gpu.sh's workdir): a previous run's are moved aside, so
# the first "SERVING" seen is this run's.
logs=/tmp/pdserve-gpu-suite
mkdir -p "$logs/previous"
mv "$logs"/service-*.log "$logs/previous/" 2>/dev/null
OUT=$OUT/suite bash "$(dirname "${BASH_SOURCE[0]}")/run_gpu.sh" suite "$@" >"$OUT/suite.log" 2>&1 &
suite=$!
# The load starts once the service is SERVING (its start-up, compiling and capturing
# graphs, takes from seconds to minutes): the window opens PROFILE_AFTER_S after that.
for _ in $(seq 1200); do
  grep -qs "pools warm; SERVING" "$logs"/service-*.log && break
  kill -0 "$suite" 2>/dev/null || break
  sleep 0.5
done
sleep "${PROFILE_AFTER_S:-15}"
for pid in $(pgrep -f "pdserve serve|bin/pdserve|router.cli.main") $(pgrep -f "ray::(Prefill|Decode|Colocated)Worker"); do
  name=$(tr '\0' ' ' </proc/"$pid"/cmdline | cut -c1-40 | tr -c 'a-zA-Z0-9\n' '_')
  "$pyspy" record --pid "$pid" --duration "${PROFILE_FOR_S:-10}" --rate 200 --format raw \
    --threads $how --output "$OUT/$pid-$name.txt" >/dev/null 2>&1 &
  if [[ -n ${PROFILE_GIL:-} ]]; then
    "$pyspy" record --pid "$pid" --duration "${PROFILE_FOR_S:-10}" --rate 200 --format raw \
      --threads --gil --nonblocking --output "$OUT/$pid-$name-gil.txt" >/dev/null 2>&1 &
  fi
done
wait "$suite"
wait
tail -25 "$OUT/suite.log"
