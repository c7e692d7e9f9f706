#!/usr/bin/env bash
# scripts/phase.sh NAME COMMAND...: run COMMAND and say how long it took ("make test: lint took 31 s").
# With MIXRL_PHASE_LOG set, also append "NAME<TAB>SECONDS<TAB>EXIT" to that file: .ci/run prints the
# phases of `make test` as one table at the end (docs/testing.md).
set -u
name=$1
shift
start=$(date +%s)
"$@"
rc=$?
seconds=$(($(date +%s) - start))
if [ "$rc" -eq 0 ]; then
  echo "make test: $name took $seconds s"
else
  echo "make test: $name took $seconds s and failed (exit $rc)"
fi
if [ -n "${MIXRL_PHASE_LOG:-}" ]; then
  printf '%s\t%s\t%s\n' "$name" "$seconds" "$rc" >>"$MIXRL_PHASE_LOG"
fi
exit "$rc"
