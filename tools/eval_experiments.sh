#!/usr/bin/env bash
# Issue 15's experiments (docs/evaluation.md): the README's main job (`griffin train`: 300 steps of 16 x 256 tokens of
# the embedded corpus) for each family on the same prepared data (same tokens, T = 256), then
#   - the held-out loss of each (val split),
#   - Figure 5 at CPU scale: loss by token position up to 16x the training length (4096) on the held-out documents,
#   - phonebook lookup accuracy against book length,
# JSON and plots under docs/figures/evaluation/. Trained runs are reused if present (RUNS, default runs/eval15).
# Usage: bash tools/eval_experiments.sh [train|loss|position|position-tests|phonebook|all]   (default: all)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-runs/eval15}
OUT=${OUT:-docs/figures/evaluation}
THREADS=${THREADS:-0}
step=${1:-all}
DATA=$RUNS/griffin-cpu/data
CKPTS=()
for fam in griffin hawk mqa; do CKPTS+=("$RUNS/$fam-cpu/checkpoints/latest"); done
LABELS=(--label Griffin --label Hawk --label MQA)

if [[ $step == train || $step == all ]]; then
  for fam in griffin hawk mqa; do
    if [[ ! -e $RUNS/$fam-cpu/checkpoints/step_00000300 ]]; then
      data=(); [[ $fam != griffin ]] && data=(--data "$DATA")
      /usr/bin/time -f "$fam-cpu: %e s wall" griffin train --preset $fam-cpu --out "$RUNS/$fam-cpu" "${data[@]}" \
        --threads "$THREADS" --no-progress
    fi
  done
fi
if [[ $step == loss || $step == all ]]; then
  griffin eval loss "${CKPTS[@]}" "${LABELS[@]}" --data "$DATA" --split val --out "$OUT"
fi
if [[ $step == position || $step == all ]]; then
  griffin eval loss "${CKPTS[@]}" "${LABELS[@]}" --data "$DATA" --split val --per-position --max-length 4096 \
    --buckets 24 --out "$OUT"
fi
if [[ $step == phonebook || $step == all ]]; then
  griffin eval phonebook "${CKPTS[@]}" "${LABELS[@]}" --entries 5,10,20,40 --seeds 0,1,2 --samples 10 \
    --out "$OUT"
fi
if [[ $step == position-tests || $step == all ]]; then
  # more held-out documents of the same kind: the standard library's own test suites, which the embedded corpus leaves
  # out (test_*.py: the first 48 files of at least 4096 bytes, in sorted order)
  tests=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['stdlib'] + '/test')")
  griffin eval loss "${CKPTS[@]}" "${LABELS[@]}" --data "$tests"/test_*.py --per-position --max-length 4096 --buckets 24 \
    --max-documents 48 --out "$OUT/stdlib-tests"
fi
