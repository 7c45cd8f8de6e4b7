#!/usr/bin/env bash
# The attention, STU-layer and host-time benchmarks of a previous revision and of this tree, one after the
# other on the same GPU, in one call (the "no slowdown against the previous commit" check).
#
#   git archive REV hstu_inductor benchmarks | (mkdir -p .baseline && tar -x -C .baseline)   # on the dev box
#   OUT=outdir bash benchmarks/compare_revisions.sh                                          # on the GPU
#
# .baseline/ is git-ignored; carry it to the GPU machine with the tree. Kernels compile untuned
# (HSTU_INDUCTOR_AUTOTUNE=0) in both trees, so the same configurations run and only the code differs.
set -u
export HSTU_INDUCTOR_AUTOTUNE=0
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/benchmarks/out}
mkdir -p "$OUT"
run() {  # tree label timeout cmd...
  local tree=$1 label=$2 tmo=$3
  shift 3
  echo "=== $label (${tree}) $(date +%T) ==="
  (cd "$ROOT/$tree" && PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$ROOT/$tree" timeout "$tmo" "$@") \
    > "$OUT/${label}_${tree#.}.log" 2>&1
  grep -v Warning "$OUT/${label}_${tree#.}.log" | tail -14
}
for t in .baseline . .baseline .; do
  run $t attention 120 python3 benchmarks/attention.py --n 1024 4096 --providers hstu_op --modes fwd bwd --rep 50 \
    --out "$OUT/attention_${t#.}"
done
for t in .baseline .; do
  run $t stu_layer 120 python3 benchmarks/stu_layer.py --n 1024 --providers hstu --no-model --rep 50 \
    --out "$OUT/stu_${t#.}"
done
for t in .baseline . .baseline .; do
  run $t op_overhead 90 python3 benchmarks/op_overhead.py --n 1024 --batch 8 128 --out "$OUT/overhead_${t#.}"
done
