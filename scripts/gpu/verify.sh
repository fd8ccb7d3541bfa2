#!/bin/bash
# Runs Tessera's GPU checks on a machine with a GPU and no build tools: the bundle made by
# scripts/gpu/bundle.sh (binaries, mpiexec, Debian's shared libraries) plus the CUDA libraries of
# the machine's PyTorch install (libcudart, libcudnn, libnccl).
#
# Usage: scripts/gpu/verify.sh [-b BUNDLE] [-B BASE_BUNDLE] [-o LOGDIR] [STEP...]
#   STEP: info placement kernels gradcheck mpi train nccl bench compare (default: all, in that
#   order);
#   compare-unet (compare's unet-small alone); trace (a CUPTI kernel timeline of `tessera bench`
#   of unet-small, 1 rank, into LOGDIR/trace_unet.txt: scripts/gpu/trace_report.py reads it, here
#   or on the machine, where c++filt may be missing) and profile (PyTorch's kernels of the same
#   step in channels_last, scripts/gpu/profile_pytorch.py); and
#   bnalone (unet-small's 1-rank step with batch norm's statistics on the GPU and on the host,
#   TESSERA_BN_ALONE=1|0, alternated); ab: with -B, a second bundle (of the code before a change) timed against BUNDLE in the same
#   run, alternating: `tessera bench --device cuda` of unet-small and of conv-bench on 1 rank and
#   on 2 ranks sharing the GPU (make it with a `git worktree` of the base commit and
#   scripts/gpu/bundle.sh there; unpack it into a folder of its own, e.g. base/).
# Each check runs under a time limit; all output goes to LOGDIR/verify.log (default $OUT, else
# gpu-logs) and to the terminal, and the results files (bench JSON, metrics) beside it.
# The last line says which steps passed and which failed; the exit status is 1 when any failed.
# Seconds each step took on an H100 (2026-11-26), for a device budget: info 1, kernels 3, mpi 35,
# gradcheck ~10, train ~10, nccl ~5, bench ~15, ab ~20, compare ~250 (each PyTorch process
# spends ~35 s in its first step: cudnn.benchmark over the 2048x2048 shapes), plus ~30 s for the
# machine's start. On an H200 (2026-11-27): kernels 2, gradcheck 10, nccl 5, mpi 36, trace 4 (its
# file ~90 MB, 5.5 MB with xz), profile 48, ab 35, train 35 (28 of them the CPU run),
# compare-unet 138. A call hands back at most 8 files: tar LOGDIR.
set -uo pipefail
cd "$(dirname "$0")/../.."
bundle=build-gpu-bundle
base=""
logs=${OUT:-gpu-logs}
while getopts b:B:o: opt; do
  case $opt in
    b) bundle=$OPTARG ;;
    B) base=$OPTARG ;;
    o) logs=$OPTARG ;;
    *) exit 2 ;;
  esac
done
shift $((OPTIND - 1))
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(info placement kernels gradcheck mpi train nccl bench compare)
bundle=$(cd "$bundle" && pwd)
[ -n "$base" ] && base=$(cd "$base" && pwd)
mkdir -p "$logs"
export PATH="$bundle/bin:$PATH"
# The CUDA libraries: PyTorch's wheels carry them (nvidia/*/lib), or a toolkit under /usr/local.
cuda_libs=""
for lib in libcudart.so.13 libcudnn.so.9 libnccl.so.2; do
  found=$(find /opt /usr/local /usr/lib -name "$lib" 2>/dev/null | head -1)
  if [ -z "$found" ]; then echo "verify: $lib not found on this machine" >&2; exit 2; fi
  cuda_libs="${cuda_libs:+$cuda_libs:}$(dirname "$found")"
done
# What cuDNN loads at run time (runtime-compiled engines: nvrtc; cuBLAS), where present.
for lib in libnvrtc.so.13 libcublasLt.so.13 libcublas.so.13; do
  found=$(find /opt /usr/local /usr/lib -name "$lib" 2>/dev/null | head -1)
  [ -n "$found" ] && cuda_libs="$cuda_libs:$(dirname "$found")"
done
export TESSERA_CUDA_LIBS="$cuda_libs"
echo "verify: CUDA libraries from $cuda_libs"
export MPIEXEC_TIMEOUT=300 HYDRA_LAUNCHER=fork
passed=()
failed=()

# run NAME LIMIT_SECONDS COMMAND...: one check, logged, under a time limit.
run() {
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $* (limit ${limit}s)" | tee -a "$logs/verify.log"
  local began=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$logs/verify.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - began)) s" | tee -a "$logs/verify.log"
  if [ "$rc" -eq 0 ]; then passed+=("$name"); else failed+=("$name(exit $rc)"); fi
  return "$rc"
}

for step in "${steps[@]}"; do
  case $step in
    info)
      run nvidia-smi 30 nvidia-smi
      run version 60 tessera --version
      run plan 60 tessera plan --model unet-small --grid 1x1x1 --image 3x2048x2048 --device cuda
      ;;
    placement)
      # Two ranks on a machine with fewer GPUs: refused on every rank without --share-devices,
      # the error naming the counts; with it, the start-up report names each rank's GPU by UUID.
      run placement_refused 60 bash -c 'out=$(mpiexec -n 2 tessera train --device cuda --steps 1 2>&1); rc=$?; echo "$out"; [ "$rc" -ne 0 ] && grep -q "2 ranks on this node but" <<<"$out"'
      run placement_shared 120 bash -c 'out=$(mpiexec -n 2 tessera train --device cuda --share-devices --steps 2 2>&1); rc=$?; echo "$out"; [ "$rc" -eq 0 ] && grep -q "rank 1 -> .* -> GPU 0 (.*, GPU-" <<<"$out"'
      ;;
    kernels)
      run gpu_tests 300 gpu_tests
      ;;
    gradcheck)
      run gradcheck_1rank_f64 120 tessera gradcheck --device cuda --dtype float64
      run gradcheck_2rank_f64 120 mpiexec -n 2 tessera gradcheck --device cuda --share-devices --dtype float64
      run gradcheck_4rank_unet_f64 180 mpiexec -n 4 tessera gradcheck --device cuda --share-devices --dtype float64 --model unet-small --grid 1x2x2 --height 64 --width 72
      run gradcheck_3rank_uneven_f64 180 mpiexec -n 3 tessera gradcheck --device cuda --share-devices --dtype float64 --model unet-small --grid 1x1x3 --height 40 --width 52
      # 128 rows over 3 in 32 units of 4 (README "The grid"): rows [0, 44), no pooling halos.
      run gradcheck_3rank_aligned_f64 180 mpiexec -n 3 tessera gradcheck --device cuda --share-devices --dtype float64 --model unet-small --grid 1x3x1 --height 128 --width 64
      run gradcheck_4rank_dp_f64 180 mpiexec -n 4 tessera gradcheck --device cuda --share-devices --dtype float64 --model convnet-small --grid 2x1x2
      # Data parallel only: every tile the whole image, so the 3x3 convs compute windowless there.
      run gradcheck_2rank_dp_unet_f64 180 mpiexec -n 2 tessera gradcheck --device cuda --share-devices --dtype float64 --model unet-small --grid 2x1x1
      run gradcheck_2rank_f64_deterministic 120 mpiexec -n 2 tessera gradcheck --device cuda --share-devices --dtype float64 --deterministic --model unet-small
      run gradcheck_2rank_f32 120 mpiexec -n 2 tessera gradcheck --device cuda --share-devices --dtype float32 --model unet-small
      ;;
    mpi)
      TESSERA_KERNELS=cuda run mpi_suite_1x2x2_np4 420 mpiexec -n 4 mpi_tests --grid=1x2x2
      ;;
    train)
      run train_cuda_2rank 240 mpiexec -n 2 tessera train --device cuda --share-devices --steps 20 --log-every 5 --progress line --seed 3 --checkpoint-dir "${TMPDIR:-/tmp}/tessera-verify-ckpt" --metrics "$logs/train_cuda.jsonl"
      # Interrupted at step 10 and resumed: the losses of steps 15 and 20 as above.
      rm -rf "${TMPDIR:-/tmp}/tessera-verify-resume"
      run train_cuda_2rank_first_half 240 mpiexec -n 2 tessera train --device cuda --share-devices --steps 10 --log-every 5 --progress line --seed 3 --checkpoint-dir "${TMPDIR:-/tmp}/tessera-verify-resume"
      run train_cuda_2rank_resumed 240 mpiexec -n 2 tessera train --device cuda --share-devices --steps 20 --log-every 5 --progress line --seed 3 --checkpoint-dir "${TMPDIR:-/tmp}/tessera-verify-resume" --resume --metrics "$logs/train_cuda_resumed.jsonl"
      run train_cuda_2rank_same_losses 30 python3 scripts/gpu/same_losses.py --rtol 1e-4 "$logs/train_cuda.jsonl" "$logs/train_cuda_resumed.jsonl" 15 20
      run train_cpu_2rank 300 mpiexec -n 2 tessera train --device cpu --steps 20 --log-every 5 --progress line --seed 3
      # One rank: batch norm's statistics stay on the GPU (TESSERA_BN_ALONE); the checkpoint reads
      # its running statistics back and the resumed run loads them: the same losses at 15 and 20,
      # and the same validation loss at 20 (evaluation reads the running statistics).
      rm -rf "${TMPDIR:-/tmp}/tessera-verify-1rank"
      run train_cuda_1rank 240 tessera train --device cuda --steps 20 --log-every 5 --progress line --seed 3 --metrics "$logs/train_cuda_1rank.jsonl"
      run train_cuda_1rank_first_half 240 tessera train --device cuda --steps 10 --log-every 5 --progress line --seed 3 --checkpoint-dir "${TMPDIR:-/tmp}/tessera-verify-1rank"
      run train_cuda_1rank_resumed 240 tessera train --device cuda --steps 20 --log-every 5 --progress line --seed 3 --checkpoint-dir "${TMPDIR:-/tmp}/tessera-verify-1rank" --resume --metrics "$logs/train_cuda_1rank_resumed.jsonl"
      run train_cuda_1rank_same_losses 30 python3 scripts/gpu/same_losses.py --rtol 1e-4 "$logs/train_cuda_1rank.jsonl" "$logs/train_cuda_1rank_resumed.jsonl" 15 20
      ;;
    nccl)
      run gradcheck_nccl_1rank 120 tessera gradcheck --device cuda --transport nccl --dtype float64
      run train_nccl_1rank 180 tessera train --device cuda --transport nccl --steps 20 --log-every 10 --progress line
      ;;
    bench)
      run bench_unet_1rank 240 tessera bench --device cuda --model unet-small --steps 5
      run bench_unet_1rank_layer_sync 240 tessera bench --device cuda --model unet-small --steps 5 --layer-sync
      TESSERA_CUDNN_LOG=1 run bench_conv_1rank_layer_sync 240 tessera bench --device cuda --model conv-bench --steps 5 --layer-sync
      TESSERA_CUDNN_SEARCH=heuristic run bench_conv_1rank_heuristic 240 tessera bench --device cuda --model conv-bench --steps 5
      run bench_unet_2rank_layer_sync 240 mpiexec -n 2 tessera bench --device cuda --share-devices --model unet-small --steps 5 --layer-sync
      ;;
    ab)
      if [ -z "$base" ]; then echo "verify: step ab needs -B BASE_BUNDLE" >&2; exit 2; fi
      for round in 1 2; do
        for which in new base; do
          bin=$bundle/bin
          [ $which = base ] && bin=$base/bin
          run "ab_unet_2rank_${which}_$round" 120 mpiexec -n 2 "$bin/tessera" bench --device cuda --share-devices --model unet-small --grid 1x1x2 --steps 5 --json "$logs/ab_unet2_${which}_$round.json"
          run "ab_unet_1rank_${which}_$round" 120 "$bin/tessera" bench --device cuda --model unet-small --steps 5 --json "$logs/ab_unet1_${which}_$round.json"
          run "ab_conv_2rank_${which}_$round" 120 mpiexec -n 2 "$bin/tessera" bench --device cuda --share-devices --model conv-bench --grid 1x1x2 --steps 5 --json "$logs/ab_conv2_${which}_$round.json"
          run "ab_conv_1rank_${which}_$round" 120 "$bin/tessera" bench --device cuda --model conv-bench --steps 5 --json "$logs/ab_conv1_${which}_$round.json"
        done
      done
      ;;
    bnalone)
      # Batch norm's statistics kept on the GPU on one rank (TESSERA_BN_ALONE=1, the default)
      # against the host's (0), alternated in one run.
      for round in 1 2; do
        for v in 1 0; do
          run "bnalone_unet_1rank_${v}_$round" 120 env TESSERA_BN_ALONE=$v tessera bench --device cuda --model unet-small --steps 5 --json "$logs/bnalone_unet1_${v}_$round.json"
        done
      done
      ;;
    trace)
      # CUPTI from the machine's PyTorch install (nvidia/cu13/lib) or a toolkit.
      cupti=$(find /opt /usr/local /usr/lib -name libcupti.so.13 2>/dev/null | head -1)
      if [ -z "$cupti" ] || [ ! -f "$bundle/trace/libcupti_trace.so" ]; then
        echo "verify: step trace needs libcupti.so.13 here and the bundle's trace/libcupti_trace.so" >&2
        failed+=("trace(no CUPTI)")
        continue
      fi
      TESSERA_CUDA_LIBS="$TESSERA_CUDA_LIBS:$(dirname "$cupti")" \
        CUDA_INJECTION64_PATH="$bundle/trace/libcupti_trace.so" \
        TESSERA_TRACE_FILE="$logs/trace_unet.txt" \
        run trace_unet_1rank 240 tessera bench --device cuda --model unet-small --steps 5
      ;;
    profile)
      PYTHONUNBUFFERED=1 run profile_pytorch_channels_last 300 python3 scripts/gpu/profile_pytorch.py --model unet-small
      ;;
    compare | compare-unet)
      models=(unet-small conv-bench)
      [ "$step" = compare-unet ] && models=(unet-small)
      for model in "${models[@]}"; do
        PYTHONUNBUFFERED=1 run "compare_pytorch_$model" 400 python3 scripts/bench/compare_pytorch.py \
          --device cuda --model "$model" --tessera "$bundle/bin/tessera" --cores 1 --steps 5 \
          --no-scaling --baseline both --json "$logs/compare_$model.json"
      done
      ;;
    *) echo "verify: unknown step '$step'" >&2; exit 2 ;;
  esac
done
echo "verify: passed: ${passed[*]:-none}"
echo "verify: FAILED: ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]
