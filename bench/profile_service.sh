#!/usr/bin/env bash
# Where a loaded service spends its time: runs a GPU-suite part in the background and
# samples the router and every worker with py-spy while the load runs (one collapsed-stack
# file per process under $OUT, then `python -m bench.stack_report` sums them by function).
#
#   PROFILE_AFTER_S=40 PROFILE_FOR_S=10 bash bench/profile_service.sh \
#       --shapes 1b --parts c --concurrency 128 --rounds 16 --no-compile
#
# PROFILE_AFTER_S: seconds after the decode worker's process appears (its start-up) before
# sampling starts; PROFILE_FOR_S: how long to sample; PROFILE_NATIVE=1 adds native frames
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

before=" $(pgrep -f "DecodeWorker" | tr '\n' ' ') "  # a previous run's, still exiting
OUT=$OUT/suite bash "$(dirname "${BASH_SOURCE[0]}")/run_gpu.sh" suite "$@" >"$OUT/suite.log" 2>&1 &
suite=$!
new_worker() {
  for pid in $(pgrep -f "DecodeWorker"); do [[ $before == *" $pid "* ]] || return 0; done
  return 1
}
for _ in $(seq 600); do new_worker && break; sleep 0.5; done
sleep "${PROFILE_AFTER_S:-40}"
for pid in $(pgrep -f "pdserve serve|bin/pdserve|router.cli") $(pgrep -f "ray::(Prefill|Decode|Colocated)Worker"); do
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
