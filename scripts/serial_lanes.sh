#!/usr/bin/env bash
# scripts/serial_lanes.sh REPORTS PYTEST [ARGS...]: the serial tests of `make test` in three lanes at
# once, each lane one test at a time (docs/testing.md):
#   - control-plane: the KWOK control-plane tests (marker control_plane: they mostly wait on the API
#     server, the operator and Prometheus; measured at about a sixth of the 2-core machine busy),
#   - real-node: the real node's tests (marker real_node: its bed, the run that trains in pods, the
#     faults, the sandbox pods; much of it waits on pods starting),
#   - the other serial tests: whole `mixrl run`s, multi-process trainers; this lane prints as it goes.
# The first two lanes' output goes to REPORTS/serial-<lane>.log, printed when every lane has ended.
# JUnit files: REPORTS/serial-<lane>.xml and REPORTS/serial.xml. Exit: the first failing lane's
# status (in the order above), 5 when no lane had a test to run, else 0.
set -u
reports=$1
shift
start=$(date +%s)
lanes=(control-plane real-node)
declare -A marker=([control-plane]="serial and control_plane" [real-node]="serial and real_node")
for lane in "${lanes[@]}"; do
  (
    "$@" -m "${marker[$lane]}" --junitxml="$reports/serial-$lane.xml" >"$reports/serial-$lane.log" 2>&1
    echo "$? $(date +%s)" >"$reports/serial-$lane.end"
  ) &
done
"$@" -m "serial and not control_plane and not real_node" --junitxml="$reports/serial.xml"
other=$?
other_s=$(($(date +%s) - start))
wait
codes=()
summary="make test: serial lanes:"
for lane in "${lanes[@]}"; do
  read -r rc end <"$reports/serial-$lane.end"
  echo "===== the $lane lane (ran beside the tests above) ====="
  cat "$reports/serial-$lane.log"
  summary="$summary $lane $((end - start)) s (exit $rc),"
  codes+=("$rc")
done
echo "$summary whole runs $other_s s (exit $other)"
codes+=("$other")
for rc in "${codes[@]}"; do
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
    exit "$rc"
  fi
done
for rc in "${codes[@]}"; do
  [ "$rc" -eq 5 ] || exit 0
done
exit 5
