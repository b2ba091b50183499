#!/usr/bin/env bash
# session 14 call 3: delayed scaling with overflow recast (fp8.delayed_overflow=recast) at seeds 1-3, the rest reused
# from session 13 call 4's merged results; then its clipping count (seed 3: clipped must be 0, recast share)
set -u
export PYTHONPATH=$(ls -d $PWD/packages/*/src | paste -sd:)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
echo "${C:-unknown}" > $OUT/commit.txt
s=$SECONDS; timeout 300 python benchmarks/low_precision_convergence.py --device cuda --steps 500 --seeds 1,2,3 \
  --only fp8-delayed-recast \
  --from benchmarks/results/s13-h200-2026-12-03/call4/conv6/low_precision_convergence.json --reuse \
  --out $OUT/conv7 > $OUT/conv7.log 2>&1; echo "conv7 rc=$? $((SECONDS-s))s" >> $OUT/stages.txt
grep "^\[" $OUT/conv7.log; grep -E "delayed|baseline|tensorwise" $OUT/conv7/low_precision_convergence.md 2>/dev/null | head -12
s=$SECONDS; timeout 150 python benchmarks/fp8_delayed_clipping.py --device cuda --steps 500 --seed 3 \
  --config fp8-delayed-recast --out $OUT/clipping > $OUT/clipping.log 2>&1
echo "clipping rc=$? $((SECONDS-s))s" >> $OUT/stages.txt
cat $OUT/clipping/fp8_delayed_clipping.md 2>/dev/null | head -12; cat $OUT/stages.txt
