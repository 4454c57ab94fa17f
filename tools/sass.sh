#!/usr/bin/env bash
# tools/sass.sh FILE OUT [ROOT]: compile ROOT/FILE (a .cu of executors/, ROOT the checkout,
# default .) for sm_90a as the build does, with ptxas's resource report in OUT.ptxas and the
# SASS in OUT.sass (addresses and encodings stripped, so two builds' opcode sequences diff).
# No GPU needed. Compare two commits: a worktree of each, then
#   diff <(grep -E 'registers|spill' a.ptxas) <(grep -E 'registers|spill' b.ptxas)
#   diff <(grep -oE '^\s+(@!?U?P[0-9T] )?[A-Z][A-Z0-9._]*' a.sass) <(... b.sass)
set -euo pipefail
F=$1; O=$2; R=${3:-.}
V=$(cd "$(dirname "$0")/.." && pwd)/.venv/lib/python3.11/site-packages
INC="-I$R/core/include -I$R/executors/common -I$R/executors/cuda -I$R"
for d in gemm split rowpass backward colstats attention lm_head sm90; do INC="$INC -I$R/executors/cuda/$d"; done
nvcc -std=c++17 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -O3 -Xptxas=-v $INC \
  -isystem "$V/cutlass_library/source/include" -DGEMMFUSE_WITH_SM90_KERNELS=1 \
  -DCUTLASS_ENABLE_GDC_FOR_SM90=1 -DNDEBUG -c "$R/$F" -o "$O.o" 2> "$O.ptxas" || { cat "$O.ptxas"; exit 1; }
"$V/triton/backends/nvidia/bin/cuobjdump" -sass "$O.o" \
  | sed -E 's@/\*[0-9a-f]+\*/@@; s@/\* 0x[0-9a-f]+ \*/@@' > "$O.sass"
