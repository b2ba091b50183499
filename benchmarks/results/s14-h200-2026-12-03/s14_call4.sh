#!/usr/bin/env bash
# session 14 call 4: the casts with the new amax and jagged-amax tiles (GPU tests, expert GEMMs + mixtral2l training
# rows), the 8b4l and 1b step beside HF eager (the embedding lookup into main_grad; hf_baseline.py from shared/),
# then 8b4l bf16 / delayed+output / delayed-recast+output (the recast's cost)
set -u
export PYTHONPATH=$(ls -d $PWD/packages/*/src | paste -sd:)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/gpu.txt
echo "${C:-unknown}" > $OUT/commit.txt
s=$SECONDS; timeout 90 python -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_casts.py \
  tests/kernels/test_fp8_grouped_gemm.py tests/parallel/test_fp8_experts.py > $OUT/tests.log 2>&1
echo "tests rc=$? $((SECONDS-s))s" >> $OUT/stages.txt; tail -3 $OUT/tests.log
s=$SECONDS; timeout 230 python benchmarks/train_throughput.py --shape 8b4l,1b --skip-hf-compile \
  --hf-baseline shared/bench/hf_baseline.py --json-dir $OUT/throughput > $OUT/throughput.log 2>&1
echo "throughput rc=$? $((SECONDS-s))s" >> $OUT/stages.txt; tail -9 $OUT/throughput.log
s=$SECONDS; (cd benchmarks && timeout 100 python fp8.py --skip gemms,linears,casts,training --out $OUT/moe \
  > $OUT/moe.log 2>&1); echo "moe rc=$? $((SECONDS-s))s" >> $OUT/stages.txt; tail -12 $OUT/moe.log
s=$SECONDS; (cd benchmarks && timeout 120 python fp8.py --skip gemms,linears,casts,experts,moe_training \
  --train-configs delayed+output,delayed-recast+output --out $OUT/train > $OUT/train.log 2>&1)
echo "train rc=$? $((SECONDS-s))s" >> $OUT/stages.txt; grep "fp8.py:" $OUT/train.log; cat $OUT/stages.txt
