#!/usr/bin/env bash
# session 14 call 2: GPU tests of the embedding lookup into main_grad, the fp8 experts' weight gradients into
# main_grad (+ h kept for the down projection) and delayed scaling's overflow recast; the mixtral2l fp8 expert GEMMs
# and training rows; the 8b4l and 1b step beside HF eager (the embedding change); the expert cast tile sweep
set -u
export PYTHONPATH=$(ls -d $PWD/packages/*/src | paste -sd:)
D=benchmarks/results/s14-h200-2026-12-03
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/gpu.txt
echo "${C:-unknown}" > $OUT/commit.txt  # main's commit, passed by the caller (no git history on the device)
s=$SECONDS; timeout 120 python -m pytest -q -p no:cacheprovider tests/parallel/test_embedding_lookup.py \
  tests/kernels/test_fp8_grouped_gemm.py tests/parallel/test_fp8_experts.py tests/kernels/test_fp8_delayed.py \
  > $OUT/tests.log 2>&1; echo "tests rc=$? $((SECONDS-s))s" >> $OUT/stages.txt
tail -8 $OUT/tests.log
s=$SECONDS; (cd benchmarks && timeout 200 python fp8.py --skip gemms,linears,casts,training --out $OUT/moe \
  > $OUT/moe.log 2>&1); echo "moe rc=$? $((SECONDS-s))s" >> $OUT/stages.txt
tail -14 $OUT/moe.log
s=$SECONDS; timeout 230 python benchmarks/train_throughput.py --shape 8b4l,1b --skip-hf-compile \
  --json-dir $OUT/throughput > $OUT/throughput.log 2>&1; echo "throughput rc=$? $((SECONDS-s))s" >> $OUT/stages.txt
tail -9 $OUT/throughput.log
s=$SECONDS; timeout 60 python $D/expert_cast_sweep.py $OUT/expert_cast_sweep.json > $OUT/sweep.log 2>&1
echo "sweep rc=$? $((SECONDS-s))s" >> $OUT/stages.txt
cat $OUT/sweep.log | grep -v Warn | head -60; cat $OUT/stages.txt
