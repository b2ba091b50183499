#!/usr/bin/env bash
# session 16 call 2 (#19): the mixtral2l expert GEMMs fwd+bwd in bf16, row-wise and block-wise fp8 (the own
# block-scaled grouped Triton kernel's first GPU timing), then mixtral2l training in bf16 / row-wise / block-wise
# at 1 and 8 micro-batches per step (the experts' weight casts made once per step and reused)
set -u
export PYTHONPATH=$(ls -d $PWD/packages/*/src | paste -sd:)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/gpu.txt
cat $OUT/gpu.txt
echo "${C:-unknown}" > $OUT/commit.txt
s=$SECONDS; (cd benchmarks && timeout 540 python fp8.py --skip gemms,linears,casts,training \
  --moe-micro-batches 1,8 --moe-recipes rowwise,blockwise --out $OUT/moe > $OUT/moe.log 2>&1)
echo "moe rc=$? $((SECONDS-s))s" >> $OUT/stages.txt; tail -30 $OUT/moe.log | cut -c1-200
cat $OUT/moe/fp8.md 2>/dev/null | tail -25
cat $OUT/stages.txt
