#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test (unit, MPI, command line, PyTorch check).
# Ends with one line "N passed, N failed[, N skipped]" from Meson's test log; exits non-zero if
# anything failed.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || { echo "0 passed, 1 failed"; exit 1; }

# Oversubscribed MPI tests must not hang: MPICH's mpiexec kills a job after this many seconds.
export MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-300}
meson test -C build --print-errorlogs --num-processes 2 "$@"
status=$?

summary=$(/usr/bin/python3 - build/meson-logs/testlog.json <<'PY'
import json, sys
counts = {"passed": 0, "failed": 0, "skipped": 0}
for line in open(sys.argv[1]):
    line = line.strip()
    if not line:
        continue
    result = json.loads(line)["result"]
    if result in ("OK", "EXPECTEDFAIL"):
        counts["passed"] += 1
    elif result == "SKIP":
        counts["skipped"] += 1
    else:
        counts["failed"] += 1
print(f'{counts["passed"]} passed, {counts["failed"]} failed, {counts["skipped"]} skipped')
PY
) || summary="0 passed, 1 failed"
echo "$summary"
case "$summary" in
  *" 0 failed"*) exit $status ;;
  *) exit 1 ;;
esac
