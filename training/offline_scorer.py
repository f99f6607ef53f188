"""Scores trained heads offline, one after another, on the same held-out rows: [`OfflineScorer`] wraps
`training.evaluate_head` for a series of heads (the variants of an ablation, the keys of one head's tree), so the
target (its embeddings and LM head) and the prepared rows load once per process, and [`compact_summary`] keeps the
numbers of one budget without the per-row detail. Every budget is named by the caller: a head's own default, `"auto"`
included, is never read here (offline there are no host costs to choose a point from).

    scorer = OfflineScorer("cache/smollm2-135m", [8, 16], rows=300, new_tokens=256,
                           lookup_settings="jetspec/heads/smollm2-135m", batch_size=32)
    compact, full = scorer.score("runs/ablation/gamma4", "smollm2-135m", data, eval_fraction=0.02, seed=0)
"""

import zlib

import torch

from training.evaluate_head import held_out_rows, prepare_rows, run, store_features
from training.feature_store import FeatureStore

SUMMARY_KEYS = ("tau", "rounds", "rows", "acceptance_per_depth", "accepted_by_source")
FIRST_ROUND_KEYS = (
    "rows",
    "rows_with_target_logprob",
    "complete_paths",
    "share_below_-20_nats",
    "mean_inflation",
    "mean_draft_score",
)


class OfflineScorer:
    """Scores heads with `training.evaluate_head` on the same held-out rows of one feature store.

    Args:
        store (`str` or `os.PathLike`): the feature store folder (`training/feature_store.py`).
        budgets (`list[int]`): tree budgets scored (integers >= 1; `"auto"` is refused: nothing to choose from).
        rows (`int`): held-out rows scored (the split's first).
        new_tokens (`int`): cap on each row's answer tokens.
        lookup_settings (`str` or `None`): a head folder lending its model-free branch settings to every head;
            `None`: each head its own.
        batch_size (`int`): rows per head forward.
    """

    def __init__(self, store, budgets: list, rows: int, new_tokens: int, lookup_settings, batch_size: int):
        if not budgets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in budgets):
            raise ValueError(f"expected fixed tree budgets, integers >= 1, to score offline, got {budgets!r}")
        self.store = FeatureStore(store)
        self.budgets, self.rows, self.new_tokens, self.batch_size = budgets, rows, new_tokens, batch_size
        self.lookup_path = lookup_settings
        self.targets, self.prepared_rows = {}, {}  # loaded once per process: target name -> model, split -> rows

    def settings(self) -> dict:
        """What a stored score depends on besides the head: rescored when any of it changes."""
        return {
            "eval_rows": self.rows,
            "eval_new_tokens": self.new_tokens,
            "budgets": self.budgets,
            "lookup_settings": str(self.lookup_path),
        }

    def target(self, name: str):
        """The float32 target `name`, loaded on first use."""
        if name not in self.targets:
            from jetspec.targets import load_target

            self.targets[name] = load_target(name, dtype=torch.float32)[0]
        return self.targets[name]

    def prepared(self, data: list, eval_fraction: float, seed: int, depth: int):
        """`(rows, skipped)` of the held-out split of `data`, prepared for a head of tree depth `depth`."""
        key = (tuple(map(str, data)), eval_fraction, seed, depth)
        if key not in self.prepared_rows:
            held = held_out_rows(data, eval_fraction, seed, self.rows)
            self.prepared_rows[key] = prepare_rows(held, store_features(self.store), self.new_tokens, depth)
        return self.prepared_rows[key]

    def score(
        self, head_dir, target: str, data: list, eval_fraction: float, seed: int, tree_keys=(None,)
    ) -> tuple[dict, dict]:
        """`(compact, full)`: per tree key (None: the head's), `lookup_on` / `lookup_off`, per budget; `compact`
        without the per-row detail, `full` with it."""
        from modeling_jetspec import JetSpecDraftModel
        from modeling_jetspec.configuration_jetspec import JetSpecConfig

        head = JetSpecDraftModel.from_pretrained(head_dir, dtype=torch.float32).eval()
        head.attach_target(self.target(target))
        self.store.check(head.config.target_layer_ids, head.config.target_hidden_size)
        lookup = JetSpecConfig.from_pretrained(self.lookup_path) if self.lookup_path else None
        rows, skipped = self.prepared(data, eval_fraction, seed, head.config.tree_depth)
        if not rows:
            raise ValueError(
                f"expected held-out rows in the feature store {self.store.path} to score, got none "
                f"({len(skipped)} skipped)"
            )
        ids = [row.id for row in rows]
        compact = {
            "rows": len(rows),
            "skipped": len(skipped),
            "answer_tokens": sum(row.end - row.prompt_length for row in rows),
            "rows_crc": zlib.crc32("\n".join(ids).encode("utf-8")),
            **self.settings(),
            "by_key": {},
        }
        full = {}
        for key in tree_keys:
            entry, full[str(key)] = {}, {}
            for lookup_on in (True, False):
                side = "lookup_on" if lookup_on else "lookup_off"
                result = run(
                    {"head": head}, rows, self.budgets, lookup_on, key, self.batch_size, lookup_settings=lookup
                )["head"]
                full[str(key)][side] = {str(b): s for b, s in result.items()}
                entry[side] = {str(b): compact_summary(s) for b, s in result.items()}
            compact["by_key"][str(key)] = entry
        return compact, full


def compact_summary(summary: dict) -> dict:
    """The evaluator's numbers of one budget without the per-row detail."""
    first = summary["first_round"]
    return {
        **{k: summary[k] for k in SUMMARY_KEYS},
        "scoring": summary["shape"]["scoring"],
        "lookup": summary["shape"]["lookup"],
        "first_round": {k: first[k] for k in FIRST_ROUND_KEYS},
    }
