#!/usr/bin/env bash
# Issue 39 item 4: the prompts of training/prompts/train_mix.jsonl that no committed file answers yet, answered by
# the target (greedy, at most 256 new tokens, bf16 with a static cache where the host runs bf16 natively), packed as
# one more data file, and their features added to the feature store. Run it only when the cores are free and the
# data-against-steps table (issue 38) says more data pays.
#
#   nice -n 5 bash scripts/campaigns/more_data.sh > runs/more-data.log 2>&1 &
#
# Resumable: the regeneration writes shards and skips the prompts already answered in $OUT_DIR; rerun the command
# after a stop. Every committed file is excluded (no prompt twice; training refuses an id in two files). A stop on a
# machine that may not come back: pack what is done (`python -m training.regenerate --out data/regen_rest --export
# training/data/smollm2-135m-mix-rest.npz --export_only`) and commit it; if data/regen_rest comes back, rerun as is
# (the final export is a superset of the committed file); if not, carry on into a second file,
# `FILE=training/data/smollm2-135m-mix-rest2.npz OUT_DIR=data/regen_rest2`, which excludes the first. When it ends,
# name $FILE in the training configs' `data:` lists and in every later regeneration's --exclude, and say in
# training/data/README.md what it holds (rows and answer tokens are printed at the end).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${OUT_DIR:-data/regen_rest}
FILE=${FILE:-training/data/smollm2-135m-mix-rest.npz}
STORE=${STORE:-cache/smollm2-135m}
DTYPE=${DTYPE:-auto}  # bf16 where the host probe finds it faster (AVX-512 bf16 / AMX), float32 on AVX2-only hosts
committed=()
for f in training/data/*.npz; do
    [[ "$f" == "$FILE" ]] || committed+=("$f")
done
python -m training.regenerate --target smollm2-135m --prompts training/prompts/train_mix.jsonl --out "$OUT_DIR" \
    --max_new_tokens 256 --batch_size 32 --shard_size 32 --dtype "$DTYPE" --cache_implementation static \
    --exclude "${committed[@]}"
python -m training.regenerate --out "$OUT_DIR" --export "$FILE" --export_only
python - "$FILE" "${committed[@]}" <<'EOF'
import sys

from training.rows import load_rows

rows = load_rows(sys.argv[1:])  # refuses an id in two files
new = load_rows(sys.argv[1:2])
answer = sum(len(r["input_ids"]) - r["prompt_length"] for r in new)
print(f"{sys.argv[1]}: {len(new)} prompts, {answer} answer tokens; all files: {len(rows)} prompts, no id twice")
EOF
python -m training.feature_store --data "$FILE" --out "$STORE" --max_length 512 --dtype bfloat16
