#!/usr/bin/env bash
# The lent GPU's call for issue 56 (2026-11-30): what captured graphs would buy an 8B step, before they exist.
# Run from the repository root on the device machine (`bash docs/gpu-probe.sh`), carrying .whl (`make gpu-wheels`); writes under $OUT.
set -u
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  # 1. flex attention (the engine's choice on CUDA): engine steps, then each forward shape eager and captured
  timeout 300 python3 -m serve_app.cli bench graphs --device cuda --dtype bfloat16 --batch-sizes 1,8,32 --ks 0,2,4 \
    --context 512 --deadline 200 --out "$OUT/bench-graphs-flex"
  echo "flex probe exit $?"
  # 2. the gather backend (plain torch ops), the same probe at fewer cells
  SPECSERVE_ATTENTION_BACKEND=gather timeout 150 python3 -m serve_app.cli bench graphs --device cuda --dtype bfloat16 \
    --batch-sizes 1,32 --ks 0,4 --context 512 --deadline 90 --out "$OUT/bench-graphs-gather"
  echo "gather probe exit $?"
} 2>&1 | tee "$OUT/log.txt"
