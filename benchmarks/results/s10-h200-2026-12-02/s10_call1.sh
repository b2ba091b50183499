#!/usr/bin/env bash
# session 10 call 1: fp8 host-time Python profile, then the block-wise variants at seed 1 (500 steps each)
set -u
export PYTHONPATH=$(ls -d packages/*/src | paste -sd:)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/gpu.txt
(cd benchmarks && timeout 120 python fp8_host_time.py --out $OUT/host > $OUT/host.log 2>&1)
timeout 480 python .bench/s10_bw_variants.py $OUT/variants w-row,x-row,g-row,pow2,rowwise > $OUT/variants.log 2>&1
tail -5 $OUT/variants.log
