#!/usr/bin/env bash
# Issue 38's measurements, in order, on the finished feature store: every table of docs/results.md's claims section,
# then head depth at equal compute. Resumable: run it again after a stop and every variant already measured
# (trained and scored, results/<table>/ablation.json) is skipped; a variant cut off mid-run is trained again from its
# start. Each variant's row is written as soon as it finishes; commit results/ (and training/checkpoints/, where
# runs of 20+ minutes keep their heads) at every stop.
#
#   nice -n 5 bash scripts/claims_campaign.sh > runs/claims-campaign.log 2>&1 &
#
# MINUTES (default 15) is the training wall-clock of each claims variant; DEPTH_MINUTES (default 30) of each depth
# variant. Host kind and dtype are recorded in every result (jetspec.host).
# Each --minutes variant's steps come from a 12-step pace probe: run nothing else on the cores while a probe runs
# (a probe beside other work gives that variant fewer steps than the rest at the same minutes). Pausing the
# campaign (kill -STOP / -CONT) is safe, but the paused time counts in that row's seconds_per_step.
set -euo pipefail
cd "$(dirname "$0")/.."
STORE=${STORE:-cache/smollm2-135m}
MINUTES=${MINUTES:-15}
DEPTH_MINUTES=${DEPTH_MINUTES:-30}
ablate() { python -m scripts.ablate_head --store "$STORE" "$@"; }

# 1. causal against bidirectional block at gamma 0, 4 and 7 (gamma4 is also the forward-KL reference), then the losses
ablate --minutes "$MINUTES" --out results/claims --runs runs/claims \
    --variants gamma4 gamma0 gamma7 bidir_gamma0 bidir_gamma4 bidir_gamma7 sft reverse_kl kl_tv topk_rank
# 2. the tree key, scored on one head (the forward-KL reference) on the same rows
ablate --out results/claims-tree-keys --tree_keys logprob entropy mixed gap --head runs/claims/gamma4
# 3. data against steps: the same steps on 0.5M, 1M and all answer tokens
ablate --minutes "$MINUTES" --out results/claims-data --runs runs/claims-data --variants data_all data_1M data_0.5M
python -m scripts.results_tables --ablation results/claims/ablation.json results/claims-data/ablation.json \
    --tree_keys results/claims-tree-keys/tree_keys.json --write docs/results.md
# 4. head depth at equal compute: 1, 2 and 3 layers from a new head, and the shipped head warm-started
ablate --minutes "$DEPTH_MINUTES" --out results/depth --runs runs/depth --variants layers1 layers2 layers3 warm
python -m scripts.depth_table --ablation results/depth/ablation.json --runs runs/depth \
    --variants layers1 layers2 layers3 warm --out results/depth
