#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job on two ranks: `tessera train` with its
# defaults (the built-in unet-small on the built-in synthetic segmentation set, each image split
# over a 1x1x2 grid), then a gradcheck proving the split changed no gradient.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo
echo "+ mpiexec -n 2 build/tessera train"
mpiexec -n 2 build/tessera train
echo
echo "+ mpiexec -n 2 build/tessera gradcheck --model unet-small --grid 1x1x2"
mpiexec -n 2 build/tessera gradcheck --model unet-small --grid 1x1x2 | tail -n 3
