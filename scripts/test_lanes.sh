#!/usr/bin/env bash
# scripts/test_lanes.sh REPORTS PYTEST [ARGS...]: the tests of `make test` in four lanes (docs/testing.md):
#   - both-cores: the tests not marked serial, on both cores (pytest-xdist, a test module to a
#     worker, one torch thread each), with beside it from the start
#   - control-plane: the KWOK control-plane tests (`serial and control_plane`), one at a time: they
#     mostly wait on the API server, the operator and Prometheus (alone, about a sixth of the 2-core
#     machine busy), so they run longest and are started first;
#   then, when the both-cores lane has ended, beside what is left of the control-plane lane:
#   - real-node: the real node's tests (`serial and real_node`), one at a time,
#   - whole-runs: the other serial tests (whole `mixrl run`s, multi-process trainers), one at a time.
# Started after the both-cores lane, the control-plane lane used to run its last minutes alone on an
# idle machine; the real node's pods beside the both-cores lane took half its cores (measured:
# docs/testing.md, "Four lanes").
# The background lanes' output goes to REPORTS/<lane>.log, printed when every lane has ended; JUnit
# files REPORTS/<lane>.xml. When each lane ended (seconds from the start) goes to MIXRL_PHASE_LOG when
# set, as scripts/phase.sh's phases do. Exit: the first failing lane's status (in the order above),
# 5 when no lane had a test to run, else 0.
set -u
reports=$1
shift
start=$(date +%s)
background=(control-plane real-node)
declare -A marker=(
  [control-plane]="serial and control_plane"
  [real-node]="serial and real_node"
  [whole-runs]="serial and not control_plane and not real_node"
)
declare -A code ended

record_end() { # LANE EXIT END: record when the lane ended (END: epoch seconds)
  ended[$1]=$(($3 - start))
  code[$1]=$2
  if [ -n "${MIXRL_PHASE_LOG:-}" ]; then
    printf '%s\t%s\t%s\n' "  lane $1" "${ended[$1]}" "$2" >>"$MIXRL_PHASE_LOG"
  fi
}

in_background() { # LANE PYTEST...: run the lane's tests, their output to its log
  local lane=$1
  shift
  (
    "$@" -m "${marker[$lane]}" --junitxml="$reports/$lane.xml" >"$reports/$lane.log" 2>&1
    echo "$? $(date +%s)" >"$reports/$lane.end"
  ) &
}

in_background control-plane "$@"
OMP_NUM_THREADS=1 "$@" -n 2 --dist loadscope -m "not serial" --junitxml="$reports/both-cores.xml"
record_end both-cores $? "$(date +%s)"
in_background real-node "$@"
"$@" -m "${marker[whole-runs]}" --junitxml="$reports/whole-runs.xml"
record_end whole-runs $? "$(date +%s)"

wait
for lane in "${background[@]}"; do
  read -r rc end <"$reports/$lane.end"
  echo "===== the $lane lane (ran beside the tests above) ====="
  cat "$reports/$lane.log"
  record_end "$lane" "$rc" "$end"
done

order=(both-cores control-plane real-node whole-runs)
summary="make test: lanes ended after"
for lane in "${order[@]}"; do
  summary="$summary $lane ${ended[$lane]} s (exit ${code[$lane]}),"
done
echo "${summary%,}"
for lane in "${order[@]}"; do
  if [ "${code[$lane]}" -ne 0 ] && [ "${code[$lane]}" -ne 5 ]; then
    exit "${code[$lane]}"
  fi
done
for lane in "${order[@]}"; do
  [ "${code[$lane]}" -eq 5 ] || exit 0
done
exit 5
