#!/usr/bin/env bash
# session 13 call 4: delayed scaling from the previous step's amax (amax_compute=most_recent) at seeds 1-3, the rest
# reused from call 3's merged results (every delayed variant so far ended >1% above bf16, seed 3 the worst)
set -u
export PYTHONPATH=$(ls -d $PWD/packages/*/src | paste -sd:)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
timeout 240 python benchmarks/low_precision_convergence.py --device cuda --steps 500 --seeds 1,2,3 \
  --only fp8-delayed-most-recent \
  --from benchmarks/results/s13-h200-2026-12-03/call3/conv5/low_precision_convergence.json --reuse \
  --out $OUT/conv6 > $OUT/conv6.log 2>&1
grep "^\[" $OUT/conv6.log; grep -E "delayed|baseline" $OUT/conv6/low_precision_convergence.md 2>/dev/null | head -6
