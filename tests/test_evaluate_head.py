"""Offline head evaluation (training/evaluate_head.py): replayed over rows the target answered greedily in float32, it
drafts the same trees, takes the same rounds and commits the same tokens as real `generate` with the head, and it
refuses bad arguments before any work."""

import json

import numpy as np
import pytest
import torch

import modeling_jetspec.decode as decode
from jetspec.provenance import weights_digest
from modeling_jetspec import JetSpecDraftModel
from test_training import VOCAB, save_target_folder, sharp_target
from jetspec.tiny import oracle_head, tiny_head
from training import evaluate_head
from training.eval_rows import decode_rows, forward_features, held_out_rows, prepare_rows
from training.evaluate_head import tree_shape
from training.feature_store import build_feature_store
from training.replay import calibration_table, evaluate
from training.rows import row_key

LOOKUP = dict(
    tree_lookup=8,
    tree_lookup_branches="trie",
    tree_lookup_prior=[[0.5, 0.3], [0.7, 0.5], [0.9, 0.8]],
    tree_lookup_record=True,
)
NEW_TOKENS = 24


def greedy_rows(target, count: int = 5, new_tokens: int = 40, seed: int = 0):
    """Rows answered by plain greedy `generate` at batch 1, float32: prompts of varied lengths."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(count):
        prompt = torch.randint(1, VOCAB, (1, 5 + 2 * i), generator=g)
        out = target.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=new_tokens, pad_token_id=0
        )
        rows.append({"id": f"row-{i}", "input_ids": out[0].tolist(), "prompt_length": prompt.shape[1]})
    return rows


def real_decode(target, head, row, budget, monkeypatch, **tree):
    """Real `generate` with the head at batch 1: its statistics and the trees its rounds drafted."""
    trees = []
    original = decode.draft

    def spy(*args, **kwargs):
        drafted = original(*args, **kwargs)
        trees.append((drafted.host[0], drafted.sizes[0]))
        return drafted

    monkeypatch.setattr(decode, "draft", spy)
    prompt = torch.tensor([row["input_ids"][: row["prompt_length"]]])
    out = target.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        pad_token_id=0,
        max_new_tokens=NEW_TOKENS,
        assistant_model=head,
        return_dict_in_generate=True,
        tree_budget=budget,
        **tree,
    )
    monkeypatch.setattr(decode, "draft", original)
    # the row is the target's own greedy answer: tree decoding writes it again
    assert out.sequences[0].tolist() == row["input_ids"][: row["prompt_length"] + NEW_TOKENS]
    return out.jetspec_stats, trees


def real_tau(target, head, rows, budget: int, new_tokens: int | None = None, **tree) -> float:
    """tau counted from real `generate` with the head, one row at a time: the tokens each call wrote after its
    prefill's, over its target forwards after the prefill (one verify per round on an attention target). Each call
    must write the row's own answer again (capped at `new_tokens`), or the count is of something else."""
    tokens = rounds = 0
    for row in rows:
        prompt = torch.tensor([row["input_ids"][: row["prompt_length"]]])
        answer = len(row["input_ids"]) - row["prompt_length"]
        out = target.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            pad_token_id=0,
            max_new_tokens=min(answer, new_tokens or answer),
            assistant_model=head,
            return_dict_in_generate=True,
            tree_budget=budget,
            **tree,
        )
        written = out.sequences[0, prompt.shape[1] :].tolist()
        assert written == row["input_ids"][row["prompt_length"] :][: len(written)]
        tokens += len(written) - 1
        rounds += out.jetspec_stats.target_forwards - 1
    return tokens / rounds


def nodes_of(drafted):
    """A drafted tree's own nodes (the round's padding dropped): tokens, parents, scores."""
    tree, n = drafted
    return tree.tokens[:n], tree.parents[:n], tree.scores[:n]


# a calibration that reverses the head's order at depth 1 and puts the branch's nodes last: trees unlike raw ones
CALIBRATION = {
    "1:head": [0.9 - 0.05 * b for b in range(10)],
    "1:lookup": [0.01] * 10,
    "2:both": [0.2 + 0.05 * b for b in range(10)],
}


@pytest.mark.parametrize("setting", ["trie", "trie_calibrated", "no_lookup", "oracle"])
def test_offline_rounds_equal_real_generate(setting, monkeypatch):
    target = sharp_target()
    rows = greedy_rows(target)
    budget = {"trie": 6, "trie_calibrated": 6, "no_lookup": 12, "oracle": 10}[setting]
    lookup = setting.startswith("trie")
    tree = {} if lookup else {"tree_lookup": 0}
    fetch = forward_features(target, tiny_head(target))  # float32 features of the whole rows
    forwards = {}  # row id -> verify forwards of real `generate` on it
    for i, row in enumerate(rows if setting != "oracle" else rows[:3]):
        if setting == "oracle":  # a head that knows the answer, ranking it first, second or third by position
            head = oracle_head(
                target,
                torch.tensor([row["input_ids"]]),
                torch.ones(1, len(row["input_ids"])),
                mode="sometimes",
                tree_width=3,
                tree_depth=4,
            )
        elif i == 0:
            calibrated = {"tree_calibration": CALIBRATION} if setting == "trie_calibrated" else {}
            head = tiny_head(target, tree_width=4, **LOOKUP, **calibrated)  # one head for all rows (batched below)
        if setting == "oracle" or i == 0:
            head.attach_target(target)
            shape = tree_shape(head, budget, lookup)
            prepared, skipped = prepare_rows(rows if setting != "oracle" else [row], fetch, NEW_TOKENS, shape.depth)
            assert not skipped
            offline_trees = {}
            tally = evaluate(
                head,
                prepared,
                shape,
                batch_size=3,
                on_round=lambda ids, trees: [
                    offline_trees.setdefault(r, []).append(t) for r, t in zip(ids, zip(trees.host, trees.sizes))
                ],
            )
            by_id = {entry[0]: entry for entry in tally.per_row}
        stats, real_trees = real_decode(target, head, row, budget, monkeypatch, **tree)
        forwards[row["id"]] = stats.target_forwards - 1  # after the prefill: one verify per round
        _, rounds, tokens, depths = by_id[row["id"]]
        assert (rounds, tokens, depths) == (stats.row_rounds, stats.round_tokens, stats.accepted_at_depth)
        assert len(offline_trees[row["id"]]) == len(real_trees) == rounds
        for mine, real in zip(offline_trees[row["id"]], real_trees):
            tokens_mine, parents_mine, scores_mine = nodes_of(mine)
            tokens_real, parents_real, scores_real = nodes_of(real)
            assert (tokens_mine, parents_mine) == (tokens_real, parents_real)
            assert scores_mine == pytest.approx(scores_real, abs=1e-4)
    if setting != "oracle":  # the batched replay of all rows: the same rounds and tokens as the real calls together
        assert tally.rows == len(rows)
    # tau from an independent count: each row's answer (NEW_TOKENS, real `generate` wrote it again) less the prefill's
    # token, over the verify forwards real `generate` ran on the same rows
    verifies = [forwards[row_id] for row_id, *_ in tally.per_row]
    assert tally.tau == pytest.approx((NEW_TOKENS - 1) * len(verifies) / sum(verifies))
    accepted = sum(tally.sources.values())
    assert accepted == sum(tally.accepted_at_depth)
    if setting == "oracle":  # every accepted token came from the head
        assert tally.sources["head"] == accepted > 0
    if setting == "trie":  # greedy tiny targets loop: the model-free branch carries accepted tokens
        assert tally.sources["lookup"] + tally.sources["both"] > 0


def test_decode_rows_is_the_reference_the_replay_meets():
    """`decode_rows` (what run_trainer's measured tau and scripts/offline_vs_generate call) writes each row's own
    greedy answer again, and its rounds, tokens and depths per row are the offline replay's at the head's defaults."""
    target = sharp_target()
    rows = greedy_rows(target, count=3)
    head = tiny_head(target, tree_width=4, **LOOKUP)
    decoded = decode_rows(target, head, rows, NEW_TOKENS)
    assert [d["id"] for d in decoded] == [row["id"] for row in rows]
    for row, d in zip(rows, decoded):
        assert d["answer"] == row["input_ids"][row["prompt_length"] : row["prompt_length"] + NEW_TOKENS]
        assert d["tokens"] == NEW_TOKENS - 1  # every token after the prefill's came from a verify round
    head.attach_target(target)
    prepared, skipped = prepare_rows(rows, forward_features(target, head), NEW_TOKENS, head.config.tree_depth)
    assert not skipped
    tally = evaluate(head, prepared, tree_shape(head), batch_size=3)
    by_id = {entry[0]: entry[1:] for entry in tally.per_row}
    for d in decoded:
        rounds, tokens, depths = by_id[d["id"]]
        assert (rounds, tokens, list(depths)) == (d["rounds"], d["tokens"], d["accepted_at_depth"])


def test_offline_vs_generate_keeps_rows_that_leave_their_stored_answer():
    """scripts/offline_vs_generate's real figure: every row kept, a row whose stored answer differs from what real
    decoding writes is flagged (not dropped), and tau is reported over all rows and over the rows equal to stored."""
    from test_scripts import load_script

    script = load_script("offline_vs_generate")
    target = sharp_target()
    rows = greedy_rows(target, count=3)
    p = rows[1]["prompt_length"]
    rows[1]["input_ids"][p + 4] = (rows[1]["input_ids"][p + 4] + 1) % VOCAB  # a stored answer real decoding leaves
    head = tiny_head(target, tree_width=4, **LOOKUP)
    real = script.real_generate(target, head, rows, NEW_TOKENS)
    assert [(e["id"], e["same_text"]) for e in real] == [("row-0", True), ("row-1", False), ("row-2", True)]
    reference = decode_rows(target, head, rows, NEW_TOKENS)
    assert [(e["rounds"], e["tokens"]) for e in real] == [(d["rounds"], d["tokens"]) for d in reference]
    everything, kept = script.tau_of(real), script.tau_of(real, {"row-0", "row-2"})
    assert (everything["rows"], kept["rows"]) == (3, 2)
    assert (kept["tokens"], kept["rounds"]) == (
        real[0]["tokens"] + real[2]["tokens"],
        real[0]["rounds"] + real[2]["rounds"],
    )


def test_first_round_target_logprob_comes_from_the_final_states():
    """The top-ranked path's target log-prob, over its prefix on the answer, equals the target's own log-probs."""
    target = sharp_target()
    rows = greedy_rows(target, count=3)
    head = tiny_head(target, tree_width=3)
    head.attach_target(target)
    shape = tree_shape(head, 8, lookup=False)
    prepared, _ = prepare_rows(rows, forward_features(target, head), NEW_TOKENS, shape.depth)
    first = []
    tally = evaluate(
        head, prepared, shape, on_round=lambda ids, trees: first.append((ids, trees.host)) if not first else None
    )
    entries = {e["id"]: e for e in tally.first_round}
    assert set(entries) == {row["id"] for row in rows}
    for row_id, tree in zip(*first[0]):
        row = next(r for r in rows if r["id"] == row_id)
        p = row["prompt_length"]
        ids = torch.tensor([row["input_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(target(ids).logits[0].float(), -1)  # (L, V)
        path, node = [], 0  # the top-ranked path: each node's first (best) child
        while node in tree.parents:
            node = tree.parents.index(node) + 1
            path.append(tree.tokens[node - 1])
        expected, known = 0.0, 0
        for d, token in enumerate(path):
            expected += float(logp[p + d, token])
            known = d + 1
            if token != row["input_ids"][p + 1 + d]:
                break
        entry = entries[row_id]
        assert entry["known_depth"] == known
        assert entry["target_logprob_known"] == pytest.approx(expected, abs=1e-3)
        assert entry["inflation"] == pytest.approx(entry["draft_score_known"] - expected, abs=1e-3)
    summary = tally.summary()["first_round"]
    below = sum(e["target_logprob_known"] < -20 for e in entries.values()) / len(entries)
    assert summary["share_below_-20_nats"] == below


def test_calibration_counts_trials_under_the_accepted_path():
    target = sharp_target()
    rows = greedy_rows(target, count=3)
    head = tiny_head(target, tree_width=3, **LOOKUP)
    head.attach_target(target)
    shape = tree_shape(head, 10, lookup=True)
    prepared, _ = prepare_rows(rows, forward_features(target, head), NEW_TOKENS, shape.depth)
    tally = evaluate(head, prepared, shape, calibration=True)
    table = calibration_table(tally.calibration)
    # every accepted draft token is one accepted trial
    assert sum(r["accepted"] for r in table) == sum(tally.accepted_at_depth)
    assert all(0 <= r["acceptance"] <= 1 and r["trials"] >= r["accepted"] for r in table)
    for depth_source in {(r["depth"], r["source"]) for r in table}:
        fitted = [r["fitted"] for r in table if (r["depth"], r["source"]) == depth_source]
        assert fitted == sorted(fitted)


def write_npz(path, rows):
    tokens = np.concatenate([np.array(r["input_ids"], dtype=np.uint16) for r in rows])
    offsets = np.cumsum([0] + [len(r["input_ids"]) for r in rows]).astype(np.int64)
    np.savez_compressed(
        path,
        tokens=tokens,
        offsets=offsets,
        prompt_length=np.array([r["prompt_length"] for r in rows]),
        id=np.array([r["id"] for r in rows]),
        settings=np.array(json.dumps({})),
    )
    return path


@pytest.fixture
def cli_setup(tmp_path):
    return saved_setup(tmp_path, count=12)


def saved_setup(tmp_path, count: int):
    """A saved tiny target and head with a lookup branch, `count` greedy rows in an .npz and their feature store:
    `(tmp_path, rows, data file)`."""
    target = sharp_target()
    rows = greedy_rows(target, count=count, new_tokens=20)
    head = tiny_head(target, **LOOKUP)
    head.save_pretrained(tmp_path / "head")
    save_target_folder(target, tmp_path / "target")
    data = write_npz(tmp_path / "rows.npz", rows)
    build_feature_store(target, head.config.target_layer_ids, rows, tmp_path / "store", progress=False)
    return tmp_path, rows, data


def cli(tmp_path, data, *extra, eval_fraction: str = "0.3"):
    return [
        "--head",
        str(tmp_path / "head"),
        "--data",
        str(data),
        "--feature_store",
        str(tmp_path / "store"),
        "--target",
        str(tmp_path / "target"),
        "--eval_fraction",
        eval_fraction,
        *extra,
    ]


def test_cli_scores_the_trainers_held_out_rows(cli_setup):
    from training.rows import load_rows, split_train_eval

    tmp_path, rows, data = cli_setup
    out = tmp_path / "out.json"
    evaluate_head.main(cli(tmp_path, data, "--budgets", "4,8", "--json", str(out), "--fit_calibration"))
    result = json.loads(out.read_text())
    _, held = split_train_eval(load_rows([str(data)]), 0.3, 0)
    by_budget = result["heads"][str(tmp_path / "head")]
    head = JetSpecDraftModel.from_pretrained(tmp_path / "head").eval()
    # the weights scored, by digest: the folder name alone would follow the folder's next contents
    assert result["head_identity"][str(tmp_path / "head")]["weights_sha256"] == weights_digest(tmp_path / "head")
    for budget in ("4", "8"):
        scored = sorted(entry["id"] for entry in by_budget[budget]["per_row"])
        assert scored == sorted(held["id"])
        # the score is what real decoding with the head reaches on those rows
        held_rows = [row for row in rows if row["id"] in set(held["id"])]
        assert by_budget[budget]["tau"] == pytest.approx(real_tau(sharp_target(), head, held_rows, int(budget)))
        assert "calibration" in by_budget[budget]


def test_a_fitted_calibration_is_written_applied_and_equal_to_real_decoding(cli_setup):
    """Fit on the held-out rows after the first (`--skip_rows 1`), write the map, score the rows with it: the
    calibrated replay equals real `generate` with the same map in the head's config; `none` scores raw."""
    tmp_path, rows, data = cli_setup
    fitted = tmp_path / "map.json"
    evaluate_head.main(
        cli(tmp_path, data, "--budgets", "6", "--fit_calibration", "--skip_rows", "1", "--min_trials", "1")
        + ["--calibration_out", str(fitted)]
    )
    table = json.loads(fitted.read_text())
    assert table and all(len(rates) == 10 for rates in table.values())
    held = set(held_out_rows([str(data)], 0.3, 0)["id"])
    held_rows = [row for row in rows if row["id"] in held]
    scores = {}
    for label, value in (("fitted", str(fitted)), ("raw", "none")):
        out = tmp_path / f"{label}.json"
        evaluate_head.main(cli(tmp_path, data, "--budgets", "6", "--calibration", value, "--json", str(out)))
        scores[label] = json.loads(out.read_text())["heads"][str(tmp_path / "head")]["6"]
    assert scores["fitted"]["shape"]["calibrated"] and not scores["raw"]["shape"]["calibrated"]
    calibrated = JetSpecDraftModel.from_pretrained(tmp_path / "head", tree_calibration=table).eval()
    assert scores["fitted"]["tau"] == pytest.approx(real_tau(sharp_target(), calibrated, held_rows, 6))
    raw = JetSpecDraftModel.from_pretrained(tmp_path / "head").eval()
    assert scores["raw"]["tau"] == pytest.approx(real_tau(sharp_target(), raw, held_rows, 6))


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--budgets", "8,0"], "expected --budgets"),
        (["--budgets", "x"], "expected --budgets"),
        (["--rows", "0"], "expected --rows"),
        (["--max_new_tokens", "0"], "expected --max_new_tokens"),
        (["--tree_key", "depth"], "expected --tree_key"),
        (["--eval_fraction", "0"], "expected --eval_fraction"),
        (["--skip_rows", "-1"], "expected --skip_rows"),
        (["--calibration_out", "map.json"], "expected --fit_calibration and one --head"),
        (["--calibration", "no-such-map.json"], "expected --calibration"),
    ],
)
def test_cli_refuses_bad_arguments_before_work(cli_setup, bad, message, monkeypatch):
    tmp_path, _, data = cli_setup
    monkeypatch.setattr("jetspec.targets.load_target", lambda *a, **k: pytest.fail("loaded the target"))
    with pytest.raises(ValueError, match=message):
        evaluate_head.main(cli(tmp_path, data, *bad))


def test_cli_refuses_unknown_heads_and_rows_missing_from_the_store(cli_setup, monkeypatch):
    tmp_path, rows, data = cli_setup
    monkeypatch.setattr("jetspec.targets.load_target", lambda *a, **k: pytest.fail("loaded the target"))
    with pytest.raises(ValueError, match="expected a head folder holding config.json"):
        evaluate_head.main(cli(tmp_path, data)[:1] + [str(tmp_path / "nowhere")] + cli(tmp_path, data)[2:])
    other = sharp_target(seed=3)
    fresh = greedy_rows(other, count=4, seed=5)
    for row in fresh:
        row["id"] = "fresh-" + row["id"]
    with pytest.raises(ValueError, match="missing"):
        evaluate_head.main(cli(tmp_path, write_npz(tmp_path / "fresh.npz", fresh)))
    assert row_key(fresh[0]["id"]) != row_key(rows[0]["id"])


def test_offline_tau_reaches_the_trainers_evaluation(tmp_path):
    """`OfflineTauCallback` puts the head's offline tau at its defaults next to the agreement; `offline_tau` hands
    the head back in the mode it came in."""
    import datasets

    from test_training import training_args
    from training.trainer import JetSpecTrainer

    target = sharp_target()
    rows = greedy_rows(target, count=6, new_tokens=20)
    head = tiny_head(target, **LOOKUP).train()
    fetch = forward_features(target, head)
    callback = evaluate_head.OfflineTauCallback(rows[:3], fetch=fetch, max_new_tokens=16)
    trainer = JetSpecTrainer(
        model=head,
        train_dataset=datasets.Dataset.from_list(rows[3:]),
        eval_dataset=datasets.Dataset.from_list(rows[:3]),
        target=target,
        args=training_args(tmp_path, max_steps=1),
        callbacks=[callback],
    )
    metrics = trainer.evaluate()
    head.train()
    expected = evaluate_head.offline_tau(head, rows[:3], fetch=fetch, max_new_tokens=16)
    assert head.training  # evaluated in eval mode, handed back as it came
    assert metrics["eval_offline_tau"] == expected["tau"]
    # the value is what real decoding with the head at its defaults reaches on those rows, capped alike
    assert expected["tau"] == pytest.approx(real_tau(target, head.eval(), rows[:3], head.config.tree_budget, 16))
    assert "eval_acc_depth_1" in metrics
    assert trainer.state.log_history[-1]["eval_offline_tau"] == expected["tau"]
    with pytest.raises(ValueError, match="exactly one of a feature store or a features function"):
        evaluate_head.offline_tau(head, rows[:3])


def test_two_heads_are_scored_on_the_same_rows(cli_setup, capsys):
    tmp_path, rows, data = cli_setup
    target = sharp_target()
    tiny_head(target, seed=7, **LOOKUP).save_pretrained(tmp_path / "other")
    out = tmp_path / "two.json"
    argv = cli(tmp_path, data, "--budgets", "6", "--json", str(out))
    argv[2:2] = [str(tmp_path / "other")]  # --head HEAD OTHER
    evaluate_head.main(argv)
    heads = json.loads(out.read_text())["heads"]
    first, second = (heads[str(tmp_path / name)]["6"] for name in ("head", "other"))
    assert sorted(e["id"] for e in first["per_row"]) == sorted(e["id"] for e in second["per_row"])
    assert "tau on the same rows" in capsys.readouterr().out
