#!/usr/bin/env bash
# A/B of two wheels on one GPU machine, in one call (a developer's tool): each bench runs
# REPEATS times, the two wheels interleaved (a, b, a, b, ...), each run through
# scripts/device-run.sh into $OUT/<bench>-<a|b>-<i>/, each repeat archived as ab-<i>.tgz.
# Summarise here with tools/ab_table.py over the archives unpacked into one folder.
# Here, first:  the base wheel in .gpu/a, the new one in .gpu/b (make wheel at each commit).
# There:        BENCHES="fwd train" REPEATS=3 bash scripts/device-ab.sh
#   fwd:   the five seed models, fp32, no torch.compile, no bf16 (FWD_ARGS to change)
#   train: --train on m84, m94, m99, fp32 (TRAIN_ARGS)
#   suite: --suite, fp32 (SUITE_ARGS); one run takes more than 120 s on an H200 (not measured
#          to its end), so it has its own limit (SUITE_TIMEOUT, 360 s) and an A/B of it takes
#          one repeat per device call (REPEATS=1, three calls)
set -uo pipefail
OUT=${OUT:-/tmp/gemmfuse-out}; mkdir -p "$OUT"
FWD_ARGS=${FWD_ARGS:-"--models m18,m22,m84,m94,m99 --modes fp32 --no-compile --no-bf16 --rounds 2"}
TRAIN_ARGS=${TRAIN_ARGS:-"--train --models m84,m94,m99 --modes fp32 --no-compile --no-bf16 --rounds 2"}
SUITE_ARGS=${SUITE_ARGS:-"--suite --modes fp32 --no-compile --no-bf16 --rounds 2"}
for i in $(seq "${REPEATS:-3}"); do
  for bench in ${BENCHES:-fwd train}; do
    case $bench in
      fwd) args=$FWD_ARGS; limit=${RUN_TIMEOUT:-200} ;;
      train) args=$TRAIN_ARGS; limit=${RUN_TIMEOUT:-200} ;;
      suite) args=$SUITE_ARGS; limit=${SUITE_TIMEOUT:-360} ;;
      *) echo "unknown bench $bench"; exit 2 ;;
    esac
    for w in a b; do
      dir="$OUT/$bench-$w-$i"; mkdir -p "$dir"
      WHEEL_DIR=.gpu/$w OUT="$dir" BENCH=1 BENCH_ARGS="$args" timeout "$limit" \
        bash scripts/device-run.sh > "$dir.console" 2>&1
      echo "$bench $w $i rc=$?"
    done
  done
  # One archive per repeat (at most 8 files come back from $OUT): a call cut off by its
  # limit still returns the repeats it finished.
  (cd "$OUT" && tar czf "ab-$i.tgz" --remove-files *-[ab]-"$i" *-[ab]-"$i".console)
done
