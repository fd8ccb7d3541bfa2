#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job on two ranks: a gradcheck of the built-in
# model (the image split over a 1x1x2 grid against a single rank). `tessera train` is not built yet.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo
echo "+ mpiexec -n 2 build/tessera gradcheck --model convstack-small --grid 1x1x2"
mpiexec -n 2 build/tessera gradcheck --model convstack-small --grid 1x1x2
