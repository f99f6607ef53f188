#!/usr/bin/env bash
# Issue 38's measurements on the finished feature store: head depth at equal compute, then every table of
# docs/results.md's claims section. Resumable: run it again after a stop and every variant already measured (trained
# and scored, results/<table>/ablation.json) is skipped; a variant cut off mid-run is trained again from its start.
# Each variant's row is written as soon as it finishes; commit results/ (and training/checkpoints/, where runs of
# 20+ minutes keep their heads) at every stop.
#
#   nice -n 5 bash scripts/campaigns/claims_campaign.sh > runs/claims-campaign.log 2>&1 &
#   STAGES="claims tree_keys data raw tables" nice -n 5 bash scripts/campaigns/claims_campaign.sh ...  # some stages
#   CLAIMS_VARIANTS="gamma0 kl_tv" STAGES=claims bash scripts/campaigns/claims_campaign.sh ...  # some claims variants
#
# Budgets, chosen so that the tables stay comparable when the machine changes between working sessions:
# - depth (DEPTH_MINUTES, default 30): equal wall-clock, because a deeper head costs more per step; its four rows
#   and the draft cost c must come from one host, so this stage runs first and whole in one session. Each variant's
#   steps come from a 40-step pace probe: run nothing else on the cores while a probe runs.
# - claims and data (CLAIMS_STEPS, default 2400): equal steps. Their variants cost the same per step (one layer,
#   the same blocks; only the loss, gamma or block mask changes), so equal steps is equal compute on any host, and a
#   table begun on one host can be finished on another. 2,400 steps is 15 minutes at the 0.375 s/step of the 1-layer
#   head in bf16 on the Intel AMX host (the layers1 pace probe, 2026-12-04); about 44 minutes on the AVX2-only host in
#   float32 (1.09 s/step).
# Host kind and dtype are recorded in every result (jetspec.host). Pausing the campaign (kill -STOP / -CONT) is safe,
# but the paused time counts in that row's seconds_per_step.
set -euo pipefail
cd "$(dirname "$0")/../.."
STORE=${STORE:-cache/smollm2-135m}
CLAIMS_STEPS=${CLAIMS_STEPS:-2400}
DEPTH_MINUTES=${DEPTH_MINUTES:-30}
STAGES=${STAGES:-"depth claims tree_keys data raw tables"}
ablate() { python -m scripts.ablate_head --store "$STORE" "$@"; }
stage() { [[ " $STAGES " == *" $1 "* ]]; }

# 1. head depth at equal compute: 1, 2 and 3 layers from a new head, the shipped head warm-started, and the 1-layer
#    head with a block of 16 (issue 38 item 4's block size 8 against 16: its draft costs more per step)
if stage depth; then
    ablate --minutes "$DEPTH_MINUTES" --out results/depth --runs runs/depth \
        --variants layers1 layers2 layers3 warm block16
    python -m scripts.campaigns.depth_table --ablation results/depth/ablation.json --runs runs/depth \
        --variants layers1 layers2 layers3 warm block16 --out results/depth
fi
# 2. the causal block at gamma 0, 4 and 7 (gamma4 is also the forward-KL reference) and the losses first: they pick
#    the long run's recipe (issue 39), which can start once they are in; then the bidirectional block at gamma 0, 4, 7
CLAIMS_VARIANTS=${CLAIMS_VARIANTS:-"gamma4 gamma0 gamma7 kl_tv topk_rank sft reverse_kl bidir_gamma0 bidir_gamma4 bidir_gamma7"}
if stage claims; then
    # shellcheck disable=SC2086  # one word per variant
    ablate --steps "$CLAIMS_STEPS" --out results/claims --runs runs/claims --variants $CLAIMS_VARIANTS
fi
# 3. the tree key, scored on one head (the forward-KL reference) on the same rows
if stage tree_keys; then
    ablate --out results/claims-tree-keys --tree_keys logprob entropy mixed gap --head runs/claims/gamma4
fi
# 4. data against steps: the same steps on 0.5M and 1M answer tokens; the all-data row is gamma4 (data_all's flags
#    are the forward-KL reference's, so results_tables takes that run instead of training it twice)
if stage data; then
    ablate --steps "$CLAIMS_STEPS" --out results/claims-data --runs runs/claims-data \
        --variants data_1M data_0.5M
fi
# 5. raw against regenerated data: the same ShareGPT prompts, ShareGPT's replies or the target's answers cut to the
#    same tokens per row (written once; the raw rows' target features are added to the store, a few minutes)
if stage raw; then
    [[ -f cache/raw-vs-regen/raw.npz ]] ||
        python -m scripts.campaigns.raw_answers --out cache/raw-vs-regen --answer_tokens 500000
    python -m training.feature_store --data cache/raw-vs-regen/raw.npz --out "$STORE" --max_length 512
    ablate --steps "$CLAIMS_STEPS" --out results/claims-raw --runs runs/claims-raw \
        --variants raw_sharegpt regen_sharegpt
fi
if stage tables; then
    ablations=()
    for f in results/claims/ablation.json results/claims-data/ablation.json results/claims-raw/ablation.json; do
        [[ -f "$f" ]] && ablations+=("$f")
    done
    tree_keys=()  # like the ablation files: only what has been run (results_tables refuses a missing file)
    [[ -f results/claims-tree-keys/tree_keys.json ]] && tree_keys=(--tree_keys results/claims-tree-keys/tree_keys.json)
    python -m scripts.campaigns.results_tables --ablation "${ablations[@]}" "${tree_keys[@]}" --write docs/results.md
fi
