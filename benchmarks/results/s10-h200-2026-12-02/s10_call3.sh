#!/usr/bin/env bash
# session 10 call 3: 500 steps, seed 1, the medium model at lr 6e-4 (GPT-3 125M's): bf16, each fp8 recipe, and two
# perturbations that measure the comparison's noise floor (bf16 without reduced-precision reductions; block-wise
# with the same fp8 operands multiplied in fp32)
set -u
export PYTHONPATH=$(ls -d $PWD/packages/*/src | paste -sd:)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
STEPS=500 timeout 560 python .bench/s10_bw_variants.py $OUT/v baseline,blockwise,rowwise,tensorwise,delayed,baseline-perturbed,refgemm > $OUT/variants.log 2>&1
grep '^{' $OUT/variants.log
python - <<'PY'
import json, glob, os
out = os.environ["OUT"]
rows = {}
for f in sorted(glob.glob(out + "/v/*.json")):
    d = json.load(open(f))
    r = d["result"]
    rows[d["variant"]] = {"final": d["final"], "losses": r["losses"], "grad_norms": r["grad_norms"], "step_s": r["step_s"], "peak_mem_gb": r["peak_mem_gb"]}
json.dump(rows, open(out + "/curves.json", "w"))
b = rows["baseline"]["final"]
for k, v in rows.items():
    print(k, round(v["final"], 4), "%+.2f%%" % (100 * (v["final"] / b - 1)), "max gn", round(max(v["grad_norms"][50:]), 2))
PY
rm -rf $OUT/v
