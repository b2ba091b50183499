#!/usr/bin/env bash
# session 16, the one call the device budget still allowed after eleven refused starts (344 s left; itself refused: too little time to start): the 8b4l step
# with fp32 and with bf16 gradient buffers (optim.main_grads_dtype) beside HF eager (hf_baseline.py from shared/)
set -u
export PYTHONPATH=$(ls -d $PWD/packages/*/src | paste -sd:)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/gpu.txt
cat $OUT/gpu.txt
echo "${C:-unknown}" > $OUT/commit.txt
s=$SECONDS; timeout ${LIMIT:-150} python benchmarks/train_throughput.py --shape 8b4l --grads fp32,bf16 --skip-hf-compile \
  --profile-steps 1 --hf-baseline shared/bench/hf_baseline.py --json-dir $OUT/throughput --runs-dir /tmp/runs \
  > $OUT/throughput.log 2>&1
echo "throughput rc=$? $((SECONDS-s))s" >> $OUT/stages.txt; tail -8 $OUT/throughput.log
grep -A12 "^step window" $OUT/throughput.log | cut -c1-110
cat $OUT/stages.txt
