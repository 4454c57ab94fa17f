#!/usr/bin/env bash
# Runs the project's real attention and transposed-split GoogleTest files
# (tests/cpp/cuda_attention_test.cpp, cuda_attention_nonfinite_test.cpp,
# cuda_split_transposed_test.cpp), unchanged, on the CPU through the fiber emulator (emu.h) and
# host stubs of the CUDA runtime (emu_rt.h): no GPU, no libcudart.
#   1. copy executors/cuda/attention/*, the transposed split's sources, cuda_check.h and
#      device_info.h to $GT_DIR/src, patch them with patch.py (launches -> emu::launch,
#      dynamic smem, mma asm -> emu::mma)
#   2./3. build $GT_DIR/attention_gtests with g++ (-include emu_rt.h everywhere) + GoogleTest
#   4. run it in each mode of $MODES, in parallel, each under a timeout:
#        plain: exact fp32 accumulation of the mma products
#        rz:    EMU_RZ=16 EMU_XB=3 (the tensor core's truncating adds)
# Usage: tools/kernel_emu/run_gtests.sh [gtest args, e.g. --gtest_filter='CudaAttention.Backward*']
# Env:   GT_DIR (default /tmp/emu/gt), MODES (default "plain rz"), TIMEOUT (s, default 900),
#        GEMMFUSE_SEED (passed through: repeats a seed), BUILD_ONLY=1, JOBS (default 2)
# Logs:  $GT_DIR/logs/<mode>.log; exit status non-zero if any mode failed.
set -euo pipefail
EMU=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$EMU/../.." && pwd)
W=${GT_DIR:-/tmp/emu/gt}
MODES=${MODES:-plain rz}
TIMEOUT=${TIMEOUT:-900}
JOBS=${JOBS:-2}
CUDA_INC=${CUDA_INC:-/usr/local/cuda/include}
CXX=${CXX:-g++}
FLAGS=(-std=c++20 -O2 -g0 -w -pthread)

# ---- 1. copy and patch ----------------------------------------------------------------------
rm -rf "$W/src" "$W/obj"
mkdir -p "$W/src" "$W/obj" "$W/logs"
cp "$ROOT"/executors/cuda/attention/*.{cu,cuh,h} "$W/src/"
# the transposed split (dW's) and what it includes: split.h's per-value helpers as host code
cp "$ROOT"/executors/cuda/split/{split.h,column_stats.cuh,split_f16x2_transposed.cu} "$W/src/"
cp "$ROOT/executors/cuda/cuda_check.h" "$W/src/"     # the real one: cudaGetLastError etc. stubbed
cp "$ROOT/executors/cuda/device_info.h" "$W/src/"    # device queries answered by emu.h's stubs
cp "$ROOT/executors/cuda/buffer_layout.h" "$W/src/"  # the workspaces' layouts
# the backward's row stage (backward_rows.cu, row_backward.cu), its layout and the row ops
cp "$ROOT"/executors/cuda/backward/{row_backward.cu,row_backward.h,backward_rows.cu,backward_stages.h} "$W/src/"
cp "$ROOT"/executors/cuda/backward/{backward_layout.h,backward_layout.cpp} "$W/src/"
cp "$ROOT"/executors/cuda/{selection.h,sm90/gemm_f16x3.h,gemm/weight_grad_f16x3.h} "$W/src/"
cp "$ROOT"/executors/common/*.h "$EMU/stubs.cpp" "$W/src/"
cp "$EMU/emu.h" "$EMU/emu_rt.h" "$EMU/patch.py" "$W/src/"
(cd "$W/src" && python3 patch.py attention_f16x3.cu attention_f16x3_backward.cu attention_nonfinite.cu \
   attention_tiles.cuh split.h column_stats.cuh split_f16x2_transposed.cu row_team.h row_backward.cu \
   backward_rows.cu) | tee "$W/logs/patch.log"
# patch.py must have found the dynamic smem of both big kernels, the one mma asm and the one ex2
grep -q 'attention_f16x3.cu launches [1-9].* smem 1' "$W/logs/patch.log" &&
  grep -q 'attention_f16x3_backward.cu launches [1-9].* smem 1' "$W/logs/patch.log" &&
  grep -q 'attention_tiles.cuh .* mma 1 ldsm 2 .* ex2 1' "$W/logs/patch.log" ||
  { echo "patch.py did not match the sources (see $W/logs/patch.log)" >&2; exit 2; }
if grep -n '<<<\|asm volatile\|asm(\|extern __shared__' "$W"/src/*.cu "$W"/src/*.cuh; then
  echo "unpatched CUDA constructs left (above)" >&2; exit 2
fi

# ---- GoogleTest: a prebuilt library, else its sources ----------------------------------------
GTEST_LIBS=()
GTEST_INC=()
for d in /usr/lib/x86_64-linux-gnu /usr/local/lib /usr/lib "$ROOT"/build/lib; do
  if [[ -f $d/libgtest.a && -f $d/libgtest_main.a ]]; then GTEST_LIBS=("$d/libgtest_main.a" "$d/libgtest.a"); break; fi
done
if ((${#GTEST_LIBS[@]} == 0)); then
  src=""
  for d in "$ROOT"/build*/_deps/googletest-src/googletest /usr/src/googletest/googletest /usr/src/gtest; do
    [[ -f $d/src/gtest-all.cc ]] && { src=$d; break; }
  done
  [[ -n $src ]] || { echo "no GoogleTest library or sources found" >&2; exit 2; }
  echo "building GoogleTest from $src"
  "$CXX" "${FLAGS[@]}" -I"$src/include" -I"$src" -c "$src/src/gtest-all.cc" -o "$W/obj/gtest-all.o" &
  "$CXX" "${FLAGS[@]}" -I"$src/include" -I"$src" -c "$src/src/gtest_main.cc" -o "$W/obj/gtest_main.o" &
  wait
  GTEST_LIBS=("$W/obj/gtest_main.o" "$W/obj/gtest-all.o")
  GTEST_INC=(-I"$src/include")
fi

# ---- 2./3. build ------------------------------------------------------------------------------
INC=(-I"$W/src" -I"$ROOT/tests/cpp" -I"$ROOT/executors/cpu" -I"$ROOT/core/include"
     "${GTEST_INC[@]}" -I"$CUDA_INC")
compile() {  # src obj
  "$CXX" "${FLAGS[@]}" -x c++ -include "$W/src/emu_rt.h" "${INC[@]}" -c "$1" -o "$2"
}
pids=()
n=0
mkdir -p "$W/obj/core"
srcs=()
for f in attention_f16x3.cu attention_f16x3_backward.cu attention_nonfinite.cu split_f16x2_transposed.cu \
         row_backward.cu backward_rows.cu backward_layout.cpp stubs.cpp; do
  srcs+=("$W/src/$f:$W/obj/${f%.*}.o")
done
for f in cuda_attention_test.cpp cuda_attention_nonfinite_test.cpp cuda_split_transposed_test.cpp \
         cuda_row_backward_test.cpp; do
  srcs+=("$ROOT/tests/cpp/$f:$W/obj/${f%.cpp}.o")
done
for f in "$ROOT"/core/src/*.cpp "$ROOT"/core/src/passes/*.cpp; do  # the planner, for the row-stage tests
  srcs+=("$f:$W/obj/core/$(basename "${f%.cpp}").o")
done
for pair in "${srcs[@]}"; do
  compile "${pair%%:*}" "${pair##*:}" & pids+=($!)
  ((++n % JOBS == 0)) && { for p in "${pids[@]}"; do wait "$p"; done; pids=(); }
done
for p in "${pids[@]}"; do wait "$p"; done
"$CXX" "${FLAGS[@]}" "${srcs[@]##*:}" "${GTEST_LIBS[@]}" -o "$W/attention_gtests"
echo "built $W/attention_gtests"
[[ ${BUILD_ONLY:-0} == 1 ]] && exit 0

# ---- 4. run -----------------------------------------------------------------------------------
declare -A env_of=([plain]="" [rz]="EMU_RZ=16 EMU_XB=3")
pids=()
for m in $MODES; do
  (
    start=$(date +%s)
    set +e
    env ${env_of[$m]} timeout "$TIMEOUT" "$W/attention_gtests" \
      --gtest_filter='CudaAttention.*:CudaAttentionNonFinite.*:CudaSplitTransposed.*:CudaRowBackward.*' "$@" > "$W/logs/$m.log" 2>&1
    rc=$?
    echo "[ emu mode ] $m (${env_of[$m]:-exact adds}): rc $rc$([[ $rc == 124 ]] && echo ' TIMED OUT'), $(( $(date +%s) - start )) s" >> "$W/logs/$m.log"
    exit $rc
  ) & pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
for m in $MODES; do
  echo "===== $m ($W/logs/$m.log)"
  grep -E '^\[( +OK| +FAILED| +SKIPPED| +RUN|  PASSED|  FAILED|==========| emu mode)|Failure|Expected|Which is|actual|f16x3|got |element|mismatch|EMU' "$W/logs/$m.log" || true
done
exit $status
