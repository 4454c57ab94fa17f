#!/usr/bin/env bash
# One call on a GPU machine (a developer's tool): install the wheel built here, run the GPU
# tests, the sanitizers and the benchmark, and leave logs and records in $OUT.
#
# Here, first:  make wheel && mkdir -p .gpu && cp dist/gemmfuse-*.whl build/tests/cpp/gemmfuse_*tests .gpu/
#               pip download --no-deps -d .gpu/wheels pytest-xdist==3.8.0 execnet==2.1.2
#               (wheels there are installed too: the machine has no network; with xdist,
#               PYTEST_ARGS="-n 4 --dist loadfile" runs the GPU tests in 4 processes)
# There:        TESTS=1 SANITIZE=1 BENCH=1 [BENCH_ARGS="..."] [PYTEST_ARGS="..."] bash scripts/device-run.sh
#               PYTEST_PATHS="python/test_a.py ..." runs those test files only (paths from tests/).
#               SANITIZE_PY="-k ..." runs memcheck and racecheck over that pytest selection too.
#               The backward's kernels run only from Python (SANITIZE's gtests do not reach them):
#               GEMMFUSE_GPU_GRAD_FUZZ_N=8 SANITIZE_PY="-k 'fuzz_backward and cuda'" does.
#               DDP="m99 m84" runs bench.ddp on two GPUs per model; PROFILE="m94"
#               bench/micro/train_profile.py; HOST=1 the host-cost bench; ZOO="--zoo-models a,b
#               --zoo-batches small" the model zoo (ZOO_REPEATS times); DIST="fsdp2-before
#               fsdp2-after fsdp2-compile tp" bench.distributed on two GPUs.
#   GEMMFUSE_GIT_COMMIT=<hash>: the commit the bench records (the copied tree's .git may be older).
#   PYTEST_TIMEOUT, SANITIZE_TIMEOUT, BENCH_TIMEOUT, ZOO_TIMEOUT (seconds) bound each section, so
#   that a call's time limit leaves the archive written (the full GPU suite took ~330 s in 14
#   processes on an H100 at d5d901e; on an H200 at 48739ab it had not ended at 310 s).
#   The committed tree alone (uncommitted work in the checkout would reach the device's copy):
#   here `mkdir -p .gpu/src && git archive HEAD | tar -x -C .gpu/src`, there
#   `cd .gpu/src && WHEEL_DIR=../b TESTS=1 ... bash scripts/device-run.sh`.
#   Two GPUs at once: CUDA_VISIBLE_DEVICES=1 SKIP_INSTALL=1 OUT=$OUT/b ... & beside a run on GPU 0
#   that installed the wheel (one install: a second would rewrite the package under the first).
#   WHEEL_DIR=.gpu/b: the wheel and test binary from there (a branch's, to test two in one call:
#   OUT=$OUT/main bash scripts/device-run.sh; WHEEL_DIR=.gpu/b OUT=$OUT/b bash scripts/device-run.sh).
# The machine's own python3 holds torch; the wheel goes into it with --no-deps (no network).
set -uo pipefail
OUT=${OUT:-/tmp/gemmfuse-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# The carried GoogleTest binaries link the CUDA runtime and cuBLAS by name; torch's wheels have them.
NV=$(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))' 2>/dev/null)/nvidia
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}:$NV/cu13/lib:$NV/cublas/lib:$NV/cuda_runtime/lib:/usr/local/cuda/lib64
summary=()
note() { summary+=("$1"); echo "== $1"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
WHEEL_DIR=${WHEEL_DIR:-.gpu}
if [ "${SKIP_INSTALL:-0}" != 1 ]; then  # SKIP_INSTALL=1: a run beside another that installed it
  python3 -m pip install -q --no-deps --no-index --force-reinstall "$WHEEL_DIR"/gemmfuse-*.whl > "$OUT/install.log" 2>&1
  note "wheel install rc=$? $(ls "$WHEEL_DIR"/gemmfuse-*.whl)"
  if compgen -G "$WHEEL_DIR/wheels/*.whl" > /dev/null; then
    python3 -m pip install -q --no-deps --no-index "$WHEEL_DIR"/wheels/*.whl >> "$OUT/install.log" 2>&1
    note "test wheels install rc=$? $(cd "$WHEEL_DIR/wheels" && ls *.whl | tr '\n' ' ')"
  fi
fi
(cd /tmp && python3 -c 'import torch, gemmfuse; print("torch", torch.__version__, torch.cuda.get_device_name(), "gemmfuse", gemmfuse.load_library())') 2>&1 | tee -a "$OUT/install.log"

if [ "${TESTS:-0}" = 1 ]; then
  "$WHEEL_DIR"/gemmfuse_cuda_tests --gtest_brief=1 > "$OUT/cuda_tests.log" 2>&1
  note "cuda gtests rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$OUT/cuda_tests.log" | tr '\n' ' ')"
  tail -20 "$OUT/cuda_tests.log"
  # From tests/, so that the installed wheel is what the tests import.
  (cd tests && timeout ${PYTEST_TIMEOUT:-3600} python3 -m pytest ${PYTEST_PATHS:-python} -q ${PYTEST_ARGS:-}) > "$OUT/pytest_gpu.log" 2>&1
  note "pytest gpu rc=$? $(tail -1 "$OUT/pytest_gpu.log")"
  tail -25 "$OUT/pytest_gpu.log"
fi

if [ "${SANITIZE:-0}" = 1 ]; then
  for tool in memcheck racecheck; do
    timeout ${SANITIZE_TIMEOUT:-150} compute-sanitizer --tool $tool --error-exitcode 9 \
      "$WHEEL_DIR"/gemmfuse_cuda_tests --gtest_brief=1 \
      --gtest_filter="${SANITIZE_FILTER:-CudaExecutor.*:CudaRowBackward.*:-*LargerShape*:*WideRows*}" \
      > "$OUT/sanitize_tmp.log" 2>&1
    note "compute-sanitizer $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_tmp.log" | tail -1)"
    { echo "===== $tool"; cat "$OUT/sanitize_tmp.log"; } >> "$OUT/sanitize.log"
  done
  rm -f "$OUT/sanitize_tmp.log"
fi

if [ -n "${SANITIZE_PY:-}" ]; then  # the sanitizers over a pytest selection (the Python-driven kernels)
  eval "sel=(${SANITIZE_PY})"  # keeps quoted words whole: SANITIZE_PY="-k 'fp32 and m84'"
  for tool in memcheck racecheck; do
    (cd tests && timeout ${SANITIZE_TIMEOUT:-240} compute-sanitizer --tool $tool --error-exitcode 9 \
      python3 -m pytest python -q -x "${sel[@]}") > "$OUT/sanitize_py_tmp.log" 2>&1
    note "compute-sanitizer $tool (pytest $SANITIZE_PY) rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_py_tmp.log" | tail -1) $(grep -E 'passed|failed' "$OUT/sanitize_py_tmp.log" | tail -1)"
    { echo "===== $tool"; cat "$OUT/sanitize_py_tmp.log"; } >> "$OUT/sanitize_py.log"
  done
  rm -f "$OUT/sanitize_py_tmp.log"
fi

if [ -n "${DDP:-}" ]; then  # bench.ddp on two GPUs (torchrun), one run per model named
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
  for m in ${DDP}; do
    python3 -m torch.distributed.run --nproc-per-node 2 -m bench.ddp --model "$m" \
      --out "$OUT/ddp-$m.json" ${DDP_ARGS:-} > "$OUT/ddp-$m.log" 2>&1
    note "ddp $m rc=$? $(grep -E 'PASS|FAIL' "$OUT/ddp-$m.log" | tail -1 | grep -oE 'PASS|FAIL')"
    grep -vE '^(W|I)[0-9]{4}' "$OUT/ddp-$m.log" | tail -14
  done
fi

if [ -n "${DIST:-}" ]; then  # bench.distributed on two GPUs (torchrun), one run per case
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
  for c in ${DIST}; do
    timeout ${DIST_TIMEOUT:-240} python3 -m torch.distributed.run --nproc-per-node 2 \
      -m bench.distributed --case "$c" --steps 20 --out "$OUT/dist-$c.json" \
      > "$OUT/dist-$c.log" 2>&1
    note "distributed $c rc=$? $(grep -E 'PASS|FAIL' "$OUT/dist-$c.log" | tail -1 | grep -oE 'PASS|FAIL')"
    grep -vE '^(W|I)[0-9]{4}' "$OUT/dist-$c.log" | tail -12
  done
fi

if [ -n "${PROFILE:-}" ]; then  # bench/micro/train_profile.py over these models
  python3 -m bench.micro.train_profile ${PROFILE} > "$OUT/train_profile.log" 2>&1
  note "train profile rc=$?"
  cat "$OUT/train_profile.log"
fi

if [ "${BENCH:-0}" = 1 ]; then
  for i in $(seq "${BENCH_REPEATS:-1}"); do
    timeout ${BENCH_TIMEOUT:-3600} python3 -m bench --out "$OUT/bench-$i.json" ${BENCH_ARGS:-} \
      > "$OUT/bench-$i.console" 2>&1
    rc=$?; note "bench $i rc=$rc"
    # the same text is in bench-$i.log, written at the end: kept where the bench did not end
    [ "$rc" = 0 ] && rm -f "$OUT/bench-$i.console"
  done
  tail -45 "$OUT/bench-${BENCH_REPEATS:-1}".{log,console} 2>/dev/null | tr -d '\000'
fi

if [ "${HOST:-0}" = 1 ]; then  # host cost per fused chain call (bench/host.py), CPU and CUDA
  python3 -m bench --host --out "$OUT/host.json" > "$OUT/host.log" 2>&1
  note "host bench rc=$?"
  tail -8 "$OUT/host.log"
fi

if [ -n "${ZOO:-}" ]; then  # the model zoo (ZOO="--zoo-models ... --zoo-batches ..."), ZOO_REPEATS times
  for i in $(seq "${ZOO_REPEATS:-1}"); do
    eval "timeout ${ZOO_TIMEOUT:-3600} python3 -m bench --zoo --out $OUT/zoo-$i.json ${ZOO}" \
      > "$OUT/zoo-$i.log" 2>&1
    note "zoo $i rc=$?"
  done
  tail -60 "$OUT/zoo-${ZOO_REPEATS:-1}.log" | tr -d '\000'  # the progress bar leaves NULs
fi

# At most 8 files come back from $OUT: everything in one archive.
(cd "$OUT" && tar czf results.tgz --remove-files $(ls | grep -v '^results.tgz$'))
echo; echo "===== summary"; printf '%s\n' "${summary[@]}"
