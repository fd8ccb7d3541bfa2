#!/bin/bash
# Packs what a bare GPU machine needs to run Tessera's GPU checks (scripts/gpu/verify.sh) into one
# folder: the binaries of a CUDA build without oneDNN, MPICH's mpiexec and every shared library
# they load from Debian, except glibc's own and the CUDA libraries (libcudart, libcudnn, libnccl),
# which the GPU machine's PyTorch install provides.
#
# Usage: scripts/gpu/bundle.sh [BUILD_DIR] [OUT_DIR]
# Besides OUT_DIR it writes OUT_DIR-carry/bundle.tar.xz (about 15 MiB; the folder is 90 MiB, most of
# it libmpich), the form that fits the 64 MiB a call to a device machine carries: unpack it there
# in the repository's root with `tar -xJf build-gpu-bundle-carry/bundle.tar.xz`.
#   BUILD_DIR  a build configured with -Dcuda=enabled -Donednn=disabled (default build-gpu; made and
#              built here when absent)
#   OUT_DIR    the bundle (default build-gpu-bundle; build*/ is ignored by git, so a copy of the
#              working tree carries it only when asked to)
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build-gpu}
out=${2:-build-gpu-bundle}
if [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" -Dcuda=enabled -Donednn=disabled
fi
ninja -C "$build" tessera tests/gpu_tests tests/mpi_tests
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib" "$out/libexec"
cp "$build/tessera" "$build/tests/gpu_tests" "$build/tests/mpi_tests" "$out/libexec/"
# MPICH's launcher: mpiexec starts hydra_pmi_proxy from its own directory.
cp "$(readlink -f "$(command -v mpiexec.hydra)")" "$out/libexec/mpiexec"
cp "$(readlink -f "$(command -v hydra_pmi_proxy)")" "$out/libexec/hydra_pmi_proxy"
# Every library the binaries load, but glibc's (the GPU machine's own is newer) and CUDA's.
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|libpthread\.|librt\.|libresolv\.|libcudart|libcudnn|libnccl|libcuda\.)'
for exe in "$out"/libexec/*; do
  ldd "$exe" | awk '$3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r name path; do
  if ! [[ $name =~ $skip ]]; then cp -L "$path" "$out/lib/$name"; fi
done
# UCX's transports are modules it loads from a directory of its own (MPICH's ch4:ucx).
ucx=$(dirname "$(ldd "$out/libexec/tessera" | awk '/libucp/ {print $3}')")/ucx
if [ -d "$ucx" ]; then
  mkdir -p "$out/ucx"
  cp -L "$ucx"/*.so.0 "$out/ucx/"
fi
# The kernel timeline (verify.sh's step trace): a CUPTI injection library, where CUPTI is found.
cuda=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")")
for cupti in "$cuda" "$cuda/extras/CUPTI"; do
  [ -f "$cupti/include/cupti.h" ] || continue
  mkdir -p "$out/trace"
  g++ -std=c++17 -O2 -shared -fPIC -I"$cupti/include" scripts/gpu/cupti_trace.cpp \
    -o "$out/trace/libcupti_trace.so" -L"$cupti/lib" -L"$cupti/lib64" -lcupti ||
    echo "bundle: the CUPTI tracer did not build (verify.sh's step trace will say so)" >&2
  break
done
strip --strip-unneeded "$out"/libexec/* "$out"/lib/* 2>/dev/null || true
# Wrappers: the carried libraries for these binaries only (and what mpiexec starts), so that the
# GPU machine's Python (PyTorch) keeps its own libstdc++. TESSERA_CUDA_LIBS is where libcudnn, libnccl and libcudart
# are found there (scripts/gpu/verify.sh sets it).
for exe in "$out"/libexec/*; do
  [ "$(basename "$exe")" = hydra_pmi_proxy ] && continue
  name=$(basename "$exe")
  cat > "$out/bin/$name" <<WRAP
#!/bin/bash
here=\$(cd "\$(dirname "\${BASH_SOURCE[0]}")/.." && pwd)
export LD_LIBRARY_PATH="\$here/lib:\${TESSERA_CUDA_LIBS:-}\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
[ -d "\$here/ucx" ] && export UCX_MODULE_DIR="\$here/ucx"
exec "\$here/libexec/$name" "\$@"
WRAP
  chmod +x "$out/bin/$name"
done
mkdir -p "$out-carry"
tar -C "$(dirname "$out")" -cJf "$out-carry/bundle.tar.xz" "$(basename "$out")"
du -sh "$out" "$out-carry/bundle.tar.xz"
