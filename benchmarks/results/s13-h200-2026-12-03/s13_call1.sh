#!/usr/bin/env bash
# session 13 call 1 (commit a810a57): the GPU tests of the block-scale layouts and the fp32 weight gradient written
# by the GEMM into main_grad, then the 8b4l step in bf16 and block-, row-, tensor-wise (+output) (do the removed
# scale copies and wgrad copies show?), then bf16 + block-wise again with the swept cast tiles and 128x128's two
# single casts (fp8.py --sweep-casts --use-swept-casts --dual-path 128x128=two_casts)
set -u
export PYTHONPATH=$(ls -d $PWD/packages/*/src | paste -sd:)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/gpu.txt
echo a810a57 > $OUT/commit.txt
timeout 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_gemm_out.py \
  tests/kernels/test_low_precision_linear.py tests/kernels/test_fp8_casts.py tests/kernels/test_quantization.py \
  tests/parallel/test_fp8_wgrad.py > $OUT/tests.log 2>&1
tail -15 $OUT/tests.log
(cd benchmarks && timeout 230 python fp8.py --skip gemms,linears,casts,experts,moe_training \
  --train-configs blockwise+output,rowwise+output,tensorwise+output --out $OUT/train > $OUT/train.log 2>&1)
grep "fp8.py:" $OUT/train.log; tail -3 $OUT/train.log
(cd benchmarks && timeout 170 python fp8.py --sweep-casts --use-swept-casts --dual-path 128x128=two_casts \
  --skip gemms,linears,experts,moe_training --train-configs blockwise+output --out $OUT/swept > $OUT/swept.log 2>&1)
grep "fp8.py:" $OUT/swept.log; tail -3 $OUT/swept.log
ls -R $OUT | head -30
