#!/usr/bin/env bash
# session 13 call 3 (code as ee6d69b): delayed with the first and last decoder layers in bf16 at seeds 1-3 (the rest
# reused from call 2's merged results), then the mixtral2l expert GEMMs and training rows (bf16, fp8 row-wise) at
# today's main (last measured in session 8)
set -u
export PYTHONPATH=$(ls -d $PWD/packages/*/src | paste -sd:)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
timeout 300 python benchmarks/low_precision_convergence.py --device cuda --steps 500 --seeds 1,2,3 \
  --only fp8-delayed-first-last-bf16 \
  --from benchmarks/results/s13-h200-2026-12-03/call2/conv4/low_precision_convergence.json --reuse \
  --out $OUT/conv5 > $OUT/conv5.log 2>&1
grep "^\[" $OUT/conv5.log; grep -E "delayed|baseline" $OUT/conv5/low_precision_convergence.md 2>/dev/null | head -5
(cd benchmarks && timeout 220 python fp8.py --skip gemms,linears,casts,training --out $OUT/moe > $OUT/moe.log 2>&1)
tail -25 $OUT/moe.log
