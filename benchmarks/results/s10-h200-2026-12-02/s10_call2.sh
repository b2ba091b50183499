#!/usr/bin/env bash
# session 10 call 2: fp8 host-time Python profile; block-wise on its own training tensors (Triton casts vs torch bits,
# cuBLAS vs float64); 300-step seed-1 runs: bf16, block-wise x2 (run-to-run noise), reference casts, reference GEMMs, row-wise
set -u
export PYTHONPATH=$(ls -d $PWD/packages/*/src | paste -sd:)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
(cd benchmarks && timeout 100 python fp8_host_time.py --out $OUT/host > $OUT/host.log 2>&1)
STEPS=300 timeout 460 python .bench/s10_bw_variants.py $OUT/variants compare,baseline,blockwise,refcasts,refgemm,blockwise2,rowwise > $OUT/variants.log 2>&1
grep '^{' $OUT/variants.log
