#!/usr/bin/env bash
# session 14 call 1: where the fp8 expert GEMM's time goes now (kernel table, mixtral2l shapes, bf16 vs fp8), and
# how often delayed scaling clips on the GPU model (500 steps, seed 3, the worst seed of every delayed variant)
set -u
export PYTHONPATH=$(ls -d $PWD/packages/*/src | paste -sd:)
D=benchmarks/results/s14-h200-2026-12-03
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
echo "${C:-unknown}" > $OUT/commit.txt  # main's commit, passed by the caller (no git history on the device)
timeout 120 python $D/experts_profile.py $OUT/experts.json > $OUT/experts.log 2>&1
timeout 200 python benchmarks/fp8_delayed_clipping.py --device cuda --steps 500 --seed 3 --out $OUT/clipping \
  > $OUT/clipping.log 2>&1
tail -3 $OUT/experts.log; grep "==\|raw" $OUT/experts.log; cat $OUT/clipping/fp8_delayed_clipping.md 2>/dev/null | head -30
