#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test (unit, MPI, command line, PyTorch check).
# Ends with one line "N passed, N failed[, N skipped]" from Meson's test log; exits non-zero if
# anything failed.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || { echo "0 passed, 1 failed"; exit 1; }

# The fallback configuration, built (not run) wherever the main build has CUDA: a machine without
# the CUDA toolkit or oneDNN (a CI machine may be one; the GPU machine's copy is built without
# oneDNN) compiles other files and headers, and must meet no error this one did not. Unoptimised
# (buildtype plain): it is compiled, never run, and builds faster so.
fallback_failed=0
if grep -q "TESSERA_HAVE_CUDA 1" build/tessera_config.h 2>/dev/null; then
  if [ ! -f build-fallback/build.ninja ]; then
    meson setup build-fallback --buildtype=plain -Dcuda=disabled -Donednn=disabled \
      > build/fallback-setup.log 2>&1 || { cat build/fallback-setup.log; fallback_failed=1; }
  fi
  if [ "$fallback_failed" = 0 ]; then
    echo "test: building without CUDA and oneDNN too (build-fallback/)"
    ninja -C build-fallback > build/fallback.log 2>&1 || { grep -B2 -A12 "FAILED" build/fallback.log | head -60; fallback_failed=1; }
  fi
fi

# Fuzzing time per target (tests/fuzz/fuzz_tests.py; its own default is 30 s): the suite stays
# within 20 minutes on a fresh machine, installs included.
export TESSERA_FUZZ_SECONDS=${TESSERA_FUZZ_SECONDS:-15}
# Oversubscribed MPI tests must not hang: MPICH's mpiexec kills a job after this many seconds.
export MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-300}
# A build that fails leaves no test log: never count an older run's.
rm -f build/meson-logs/testlog.json
meson test -C build --print-errorlogs --num-processes 2 "$@"
status=$?

summary=$(/usr/bin/python3 - build/meson-logs/testlog.json "$fallback_failed" <<'PY'
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
failed = counts["failed"] + int(sys.argv[2])  # the fallback build, when it failed
print(f'{counts["passed"]} passed, {failed} failed, {counts["skipped"]} skipped')
PY
) || summary="0 passed, 1 failed"
[ "$fallback_failed" = 0 ] || echo "test: the build without CUDA and oneDNN failed (build/fallback.log)"
# Which backends this build has, so a CI log tells whether the CUDA code was compiled at all.
if grep -q "TESSERA_HAVE_CUDA 1" build/tessera_config.h 2>/dev/null; then
  echo "build: CUDA backend compiled ($(command -v nvcc || echo /usr/local/cuda/bin/nvcc))"
else
  echo "build: CUDA backend NOT compiled (nvcc: $(command -v nvcc || echo none on PATH)," \
       "/usr/local/cuda: $([ -d /usr/local/cuda ] && echo present || echo absent)) - see build/meson-logs/meson-log.txt"
fi
echo "$summary"
case "$summary" in
  *" 0 failed"*) exit $status ;;
  *) exit 1 ;;
esac
