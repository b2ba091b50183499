#!/usr/bin/env bash
# session 11 call 1: seed 2 of the lr-6e-4 500-step comparison (bf16 + the four fp8 recipes; seed 1 reused from
# session 10 call 3), then fp8_host_time.py (does abs_max's one-launch amax show in host us per linear?)
set -u
export PYTHONPATH=$(ls -d $PWD/packages/*/src | paste -sd:)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
timeout 450 python benchmarks/low_precision_convergence.py --device cuda --steps 500 --seeds 1,2 \
  --only fp8-tensorwise,fp8-delayed,fp8-rowwise,fp8-blockwise \
  --from benchmarks/results/s10-h200-2026-12-02/call3/as_convergence/low_precision_convergence.json --reuse \
  --out $OUT/conv2 > $OUT/conv2.log 2>&1
tail -25 $OUT/conv2.log
(cd benchmarks && timeout 100 python fp8_host_time.py --out $OUT/host > $OUT/host.log 2>&1)
tail -30 $OUT/host.log
ls -R $OUT | head -30
