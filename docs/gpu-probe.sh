#!/usr/bin/env bash
# The lent GPU's call for issue 56: static steps (captured CUDA graphs) on against off, then the checks and the
# profile with them on. Run from the repository root on the device machine (`bash docs/gpu-probe.sh`, timeout_s 540),
# carrying .whl (`make gpu-wheels`); writes under $OUT (about 8 minutes).
# DRY=1 runs the same calls on a CPU at tiny shapes (flex attention, static steps eager: no capture) in ~2 minutes:
#   DRY=1 PY=.venv/bin/python OUT=/tmp/gpu-dry bash docs/gpu-probe.sh
set -u
OUT=${OUT:-out/gpu}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -n "${DRY:-}" ]; then
  DEV=cpu SHAPE=tiny-128k:3 DTYPE=float32 QUICK=--quick BATCHES=1,4  # eager flex on a CPU is dense over the pool
  # a CPU's defaults are gather, static off and the walk: the GPU's paths instead (one_pass: one-pass acceptance)
  export SPECSERVE_ATTENTION_BACKEND=flex SPECSERVE_STATIC_STEPS=eager SPECSERVE_ONE_PASS=1
else
  DEV=cuda SHAPE=llama-3.1-8b:32 DTYPE=bfloat16 QUICK= BATCHES=1,8,32
  $PY -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
{
  [ -z "${DRY:-}" ] && nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  # 1. engine steps with static steps (graphs) on against off, paired, at batch 1 / 8 / 32 x k 0 / 2 / 4, and each
  #    forward shape eager against captured by hand: the "graphs on vs off >= 3x at batch 1"
  timeout 240 $PY -m serve_app.cli bench graphs --device $DEV --dtype $DTYPE --random $SHAPE --batch-sizes $BATCHES \
    --ks 0,2,4 --context 512 --steps 6 --deadline 170 --out "$OUT/bench-graphs"
  echo "graphs probe exit $?"
  # 2. the checks (greedy and seeded output exact at every k, sampling, syncs) with graphs on (static_steps auto)
  timeout 120 $PY -m serve_app.cli selfcheck --device $DEV $QUICK --out "$OUT/selfcheck"
  echo "selfcheck exit $?"
  # 3. the profile and its context axis (512 / 4k / 16k), measured with graphs on
  timeout 150 $PY -m serve_app.cli selfcheck --device $DEV $QUICK --full --checks '' --stages profile,context \
    --deadline 110 --out "$OUT/campaign"
  echo "campaign exit $?"
} 2>&1 | tee "$OUT/log.txt"
