#!/usr/bin/env bash
# One call on the GPU machine: GPU tests (GoogleTest, every pytest with its GPU cases), sanitizers, benchmark.
# Uses the build carried from the dev machine (build/lib, build/tests/cpp) and the GPU
# machine's own python3 + torch. Each part is switched by an env var; logs go to $OUT.
#   TESTS=1 SANITIZE=1 BENCH=1 BENCH_ARGS="..." PYTEST_ARGS="..." bash scripts/device-run.sh
#   AB=1 AB_OLD_LIB=build/oldlib/libgemmfuse_ops.so [AB_ROUNDS=3] [AB_ARGS="..."]: bench this
#     build's library against another build's, alternated, in one call (ab.log); or
#     AB_LIBS="name=path[@VAR=value[,VAR2=value2]] ..." for several (the VARs set for that entry's runs); AB_SMI=1 logs SM clock and power (ab_smi.csv)
#   GEMMFUSE_GIT_COMMIT=<hash>: the commit the bench JSON records (the copied tree's .git can be
#     older than the code; pass the dev machine's `git rev-parse --short HEAD`)
#   PROBE=1 [PROBE_ARGS="M N K"]: the CUTLASS-vs-cuBLAS GEMM probe (build/bench/cutlass_gemm_probe)
#     and the L2 residency probe (build/bench/l2_residency_probe)
set -uo pipefail
OUT=${OUT:-/tmp/gemmfuse-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python GEMMFUSE_LIB=$PWD/build/lib/libgemmfuse_ops.so
# The carried test binary links the CUDA 13 runtime and cuBLAS by name; torch's wheels have them.
NV=$(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))' 2>/dev/null)/nvidia
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}:$NV/cu13/lib:$NV/cublas/lib:$NV/cuda_runtime/lib:/usr/local/cuda/lib64
summary=()
note() { summary+=("$1"); echo "== $1"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'

if [ "${TESTS:-0}" = 1 ]; then
  build/tests/cpp/gemmfuse_cuda_tests --gtest_brief=1 > "$OUT/cuda_tests.log" 2>&1
  note "cuda gtests rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$OUT/cuda_tests.log" | tr '\n' ' ')"
  tail -30 "$OUT/cuda_tests.log"
  python3 -m pytest tests/python -q ${PYTEST_ARGS:-} > "$OUT/pytest_gpu.log" 2>&1  # every test; those with a GPU case run it
  note "pytest gpu rc=$? $(tail -1 "$OUT/pytest_gpu.log")"
  tail -40 "$OUT/pytest_gpu.log"
fi

if [ "${SANITIZE:-0}" = 1 ]; then
  for tool in memcheck racecheck; do
    timeout ${SANITIZE_TIMEOUT:-150} compute-sanitizer --tool $tool --error-exitcode 9 \
      build/tests/cpp/gemmfuse_cuda_tests --gtest_brief=1 \
      --gtest_filter="${SANITIZE_FILTER:-CudaExecutor.*:-*LargerShape*:*WideRows*}" \
      > "$OUT/sanitize_tmp.log" 2>&1
    note "compute-sanitizer $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_tmp.log" | tail -1)"
    { echo "===== $tool"; cat "$OUT/sanitize_tmp.log"; } >> "$OUT/sanitize.log"
  done
  rm -f "$OUT/sanitize_tmp.log"
fi

if [ "${PROBE:-0}" = 1 ]; then  # bench/micro/cutlass_gemm_probe.cu (built with -DGEMMFUSE_BUILD_PROBES=ON)
  build/bench/cutlass_gemm_probe ${PROBE_ARGS:-} > "$OUT/cutlass_gemm_probe.log" 2>&1
  note "cutlass gemm probe rc=$?"
  cat "$OUT/cutlass_gemm_probe.log"
  build/bench/l2_residency_probe > "$OUT/l2_residency_probe.log" 2>&1
  note "l2 residency probe rc=$?"
  cat "$OUT/l2_residency_probe.log"
fi

if [ "${AB:-0}" = 1 ]; then  # same-call A/B: rounds over the libraries, alternated
  libs=${AB_LIBS:-"new=$GEMMFUSE_LIB old=$AB_OLD_LIB"}
  if [ "${AB_SMI:-0}" = 1 ]; then  # SM clock, power and temperature while the rounds run
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu \
      --format=csv -lms 50 > "$OUT/ab_smi.csv" 2>&1 & smi=$!
  fi
  for r in $(seq "${AB_ROUNDS:-3}"); do
    for nl in $libs; do  # name=path[@VAR=value[,VAR2=value2]]: that library, with the VARs set for its runs
      spec=${nl#*=}; lib=${spec%%@*}; envs=""; [ "$spec" != "$lib" ] && envs=${spec#*@}; envs=${envs//,/ }
      env $envs GEMMFUSE_LIB=$lib python3 -m gemmfuse bench --out "/tmp/ab-${nl%%=*}-$r.json" \
        ${AB_ARGS:---models m99 --modes tf32 --no-compile} 2>&1 | grep "│ m" | sed "s/^/${nl%%=*} $r /" >> "$OUT/ab.log"
      # the medians to the microsecond (the table rounds to 1 us)
      python3 -c 'import json,sys; d=json.load(open(sys.argv[1]))
for x in d["records"]: g = x.get("gpu_state") or {}; print(sys.argv[2], x["model"], x["mode"], x["dtype"], "%.2f us" % (1e3 * x["ms"]),
  "(1-call %.2f us; rounds %s; SM %s MHz, %s W)" % (1e3 * x.get("ms_latency", float("nan")), " ".join("%.1f" % (1e3 * r) for r in x.get("ms_rounds", [])),
  g.get("sm_mhz"), g.get("power_w")))' \
        "/tmp/ab-${nl%%=*}-$r.json" "${nl%%=*} $r" >> "$OUT/ab_us.log"
    done
  done
  [ -n "${smi:-}" ] && kill $smi
  note "A/B rounds: $(wc -l < "$OUT/ab.log") lines"
  cat "$OUT/ab.log" "$OUT/ab_us.log"
fi

if [ "${OVERHEAD:-0}" = 1 ]; then
  python3 scripts/host_overhead.py --model m18 > "$OUT/host_overhead.log" 2>&1
  note "host overhead (m18): $(tr '\n' ';' < "$OUT/host_overhead.log" | tr -s ' ')"
fi

if [ "${BENCH:-0}" = 1 ]; then
  python3 -m gemmfuse bench --out "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -60
  note "bench rc=${PIPESTATUS[0]}"
fi

echo; echo "===== summary"; printf '%s\n' "${summary[@]}"
