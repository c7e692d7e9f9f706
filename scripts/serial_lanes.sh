#!/usr/bin/env bash
# scripts/serial_lanes.sh REPORTS PYTEST [ARGS...]: the serial tests of `make test` in two lanes at
# once, each lane one test at a time (docs/testing.md):
#   - the KWOK control-plane tests (marker control_plane: they mostly wait on the API server, the
#     operator and Prometheus; measured at about a sixth of the 2-core machine busy),
#   - beside them the other serial tests: whole `mixrl run`s, multi-process trainers, the real node.
# The control-plane lane's output goes to REPORTS/serial-control-plane.log and is printed when both
# lanes have ended; the other lane prints as it goes. JUnit files: REPORTS/serial-control-plane.xml
# and REPORTS/serial.xml. Exit: a lane's failure (the control-plane lane's first), 5 when neither
# lane had a test to run, else 0.
set -u
reports=$1
shift
start=$(date +%s)
(
  "$@" -m "serial and control_plane" --junitxml="$reports/serial-control-plane.xml" \
    >"$reports/serial-control-plane.log" 2>&1
  echo "$? $(date +%s)" >"$reports/serial-control-plane.end"
) &
lane=$!
"$@" -m "serial and not control_plane" --junitxml="$reports/serial.xml"
other=$?
other_s=$(($(date +%s) - start))
wait "$lane"
read -r plane plane_end <"$reports/serial-control-plane.end"
echo "===== the control-plane lane (ran beside the tests above) ====="
cat "$reports/serial-control-plane.log"
echo "make test: serial lanes: control plane $((plane_end - start)) s (exit $plane), whole runs and the real node $other_s s (exit $other)"
for rc in "$plane" "$other"; do
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
    exit "$rc"
  fi
done
if [ "$plane" -eq 5 ] && [ "$other" -eq 5 ]; then
  exit 5
fi
exit 0
