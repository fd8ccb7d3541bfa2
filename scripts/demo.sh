#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job on two ranks: `tessera train` with its
# defaults (the built-in unet-small on the built-in synthetic segmentation set, each image split
# over a 1x2x1 grid: two bands of rows), then a gradcheck proving the split changed no gradient.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo
echo "+ mpiexec -n 2 build/tessera train"
mpiexec -n 2 build/tessera train
echo
echo "+ mpiexec -n 2 build/tessera gradcheck --model unet-small --grid 1x2x1"
mpiexec -n 2 build/tessera gradcheck --model unet-small --grid 1x2x1 | tail -n 3
