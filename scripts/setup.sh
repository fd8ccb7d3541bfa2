#!/usr/bin/env bash
# Installs the Debian packages Tessera needs (only those missing) and builds into build/.
# Usage: scripts/setup.sh            (re-running is cheap: it only rebuilds what changed)
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(g++ pkg-config meson ninja-build mpich libmpich-dev libhdf5-mpich-dev zlib1g-dev
          libboost-program-options-dev libgtest-dev libgmock-dev libdnnl-dev nlohmann-json3-dev
          python3 python3-numpy python3-h5py python3-torch python3-matplotlib
          libtcmalloc-minimal4 libopenblas0-pthread  # the tuned PyTorch baseline; numpy's BLAS
          slurm-wlm munge
          clang-16 libclang-rt-16-dev llvm)  # fuzzing: clang >= 15, libFuzzer, llvm-symbolizer

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi

# The CUDA toolkit's nvcc (the GPU backend builds when it, cuDNN and NCCL are found).
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

if [ ! -f build/build.ninja ]; then
  meson setup build --buildtype=release
fi
ninja -C build
