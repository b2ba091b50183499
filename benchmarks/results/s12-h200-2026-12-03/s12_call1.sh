#!/usr/bin/env bash
# session 12 call 1: seed 3 of the lr-6e-4 500-step comparison (bf16 + the four fp8 recipes; seeds 1, 2 reused from
# session 11 call 1), then the fused-cast tile sweep + casts table (is the fused 1x128 dual cast faster now?)
set -u
export PYTHONPATH=$(ls -d $PWD/packages/*/src | paste -sd:)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/gpu.txt
timeout 430 python benchmarks/low_precision_convergence.py --device cuda --steps 500 --seeds 1,2,3 \
  --only fp8-tensorwise,fp8-delayed,fp8-rowwise,fp8-blockwise \
  --from benchmarks/results/s11-h200-2026-12-02/call1/conv2/low_precision_convergence.json --reuse \
  --out $OUT/conv3 > $OUT/conv3.log 2>&1
tail -12 $OUT/conv3.log
(cd benchmarks && timeout 140 python fp8.py --sweep-casts --skip gemms,linears,training,experts,moe_training \
  --out $OUT/casts > $OUT/casts.log 2>&1)
tail -40 $OUT/casts.log; cat $OUT/casts/*.md 2>/dev/null | head -60
