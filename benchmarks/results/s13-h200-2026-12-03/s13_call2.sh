#!/usr/bin/env bash
# session 13 call 2 (commit ee6d69b): block-wise with the first and last decoder layers in bf16, and delayed with
# e4m3 gradients, at seeds 1, 2, 3 of the lr-6e-4 500-step comparison (bf16 and the plain recipes reused from
# session 12 call 1): do the two recipes outside 1% come within it?
set -u
export PYTHONPATH=$(ls -d $PWD/packages/*/src | paste -sd:)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
echo ee6d69b > $OUT/commit.txt
timeout 500 python benchmarks/low_precision_convergence.py --device cuda --steps 500 --seeds 1,2,3 \
  --only fp8-blockwise-first-last-bf16,fp8-delayed-e4m3 \
  --from benchmarks/results/s12-h200-2026-12-03/call1/conv3/low_precision_convergence.json --reuse \
  --out $OUT/conv4 > $OUT/conv4.log 2>&1
grep "^\[" $OUT/conv4.log; cat $OUT/conv4/low_precision_convergence.md 2>/dev/null; tail -3 $OUT/conv4.log
