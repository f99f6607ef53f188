#!/usr/bin/env bash
# Issue 39, stage by stage: the long annealed run, its calibration map, and the two judgements on identical text that
# decide whether it replaces the shipped head; then the bf16 speed bench. Resumable: run it again after a stop and
# the run continues from its last checkpoint (or from the head kept at its last save, where runs/ is gone); every
# other stage writes its result file once and is skipped when that file exists. Commit training/checkpoints/ and
# results/long-run/ at every stop.
#
#   nice -n 5 bash scripts/campaigns/ship_campaign.sh > runs/ship-campaign.log 2>&1 &
#   STAGES="calibrate offline" bash scripts/campaigns/ship_campaign.sh ...      # some stages only
#
# Stages:
# - train: `training/run_trainer.py` on the long config (its schedule fixed once, annealed at its end).
# - calibrate: the new head's map, fitted on held-out rows 100 and after (never the shipping rows 0-99).
# - offline: both heads on held-out rows 0-99 x 256 at the defaults (tree-8 + trie), the new head with and without
#   its map, and the head alone (trie off): the store path issue 38 checked against real decoding.
# - bench_fp32: both heads side by side in one float32 process (bit-exact text), 3 suites x 5 x 128, at the defaults,
#   each as it would ship: the shipped folder with its own map, the new head as CANDIDATE (its weights, with its map
#   where the offline stage keeps it; `scripts/ship_decision.py --candidate`).
# - decide: `scripts/ship_decision.py` reads the three judgements into OUT/decision.json (ships only if offline tau and
#   the float32 bench both put the new head ahead; the map kept only if it raises offline tau).
# - ship (on request): the same, and when it ships, the new head replaces SHIPPED (then update the README's tables).
# - bench_bf16 (after shipping): plain, prompt lookup, the head alone and the defaults, bf16, 3 suites x 10 x 256.
set -euo pipefail
cd "$(dirname "$0")/../.."
STORE=${STORE:-cache/smollm2-135m}
CONFIG=${CONFIG:-training/configs/smollm2-135m-long.yaml}
RUN=${RUN:-runs/smollm2-135m-long}
NEW=${NEW:-training/checkpoints/smollm2-135m-long}
SHIPPED=${SHIPPED:-jetspec/heads/smollm2-135m}
OUT=${OUT:-results/long-run}
CANDIDATE=${CANDIDATE:-$RUN-candidate}  # the new head as it would ship, rewritten before each float32 bench
STAGES=${STAGES:-"train calibrate offline bench_fp32 decide"}
BF16_BUDGETS=${BF16_BUDGETS:-8}  # comma-separated; a change of the default budget is judged here, by bf16 speed
stage() { [[ " $STAGES " == *" $1 "* ]]; }
mkdir -p "$OUT"

if stage train; then
    resume=()
    if compgen -G "$RUN/checkpoint-*" > /dev/null || [[ -f "$NEW/trainer_state.json" ]]; then
        resume=(--resume_from_checkpoint true)
    fi
    python training/run_trainer.py "$CONFIG" --feature_store "$STORE" "${resume[@]}"
fi
evaluate() { python -m training.evaluate_head --feature_store "$STORE" --max_new_tokens 256 --budgets 8 "$@"; }
if stage calibrate && [[ ! -f "$OUT/calibration.json" ]]; then
    evaluate --head "$NEW" --skip_rows 100 --lookup on --fit_calibration --calibration none --min_trials 30 \
        --calibration_out "$OUT/calibration-map.json" --json "$OUT/calibration.json"
fi
if stage offline; then
    [[ -f "$OUT/offline-defaults.json" ]] || evaluate --head "$SHIPPED" "$NEW" --rows 100 --lookup on \
        --calibration none --json "$OUT/offline-defaults.json"
    if [[ -f "$OUT/calibration-map.json" && ! -f "$OUT/offline-calibrated.json" ]]; then
        evaluate --head "$NEW" --rows 100 --lookup on --calibration "$OUT/calibration-map.json" \
            --json "$OUT/offline-calibrated.json"
    fi
    [[ -f "$OUT/offline-head-alone.json" ]] || evaluate --head "$SHIPPED" "$NEW" --rows 100 --lookup off \
        --calibration none --json "$OUT/offline-head-alone.json"
fi
if stage bench_fp32 && [[ ! -f "$OUT/bench-fp32/results.json" ]]; then
    rm -rf "$CANDIDATE"
    python -m scripts.ship_decision --results "$OUT" --new "$NEW" --shipped "$SHIPPED" --candidate "$CANDIDATE"
    jetspec bench --dtype float32 --limit 5 --max-new-tokens 128 --budgets 8 --methods plain,lookup \
        --head "$CANDIDATE" --baseline-head "$SHIPPED" --out "$OUT/bench-fp32"
fi
if stage decide || stage ship; then
    apply=()
    if stage ship; then apply=(--apply); fi
    python -m scripts.ship_decision --results "$OUT" --new "$NEW" --shipped "$SHIPPED" "${apply[@]}"
fi
if stage bench_bf16 && [[ ! -f "$OUT/bench-bf16/results.json" ]]; then
    jetspec bench --dtype auto --limit 10 --max-new-tokens 256 --budgets "$BF16_BUDGETS" \
        --methods plain,prompt_lookup,tree,lookup --head "$SHIPPED" --out "$OUT/bench-bf16"
fi
