"""The continuation trie: every earlier continuation of the row's last n tokens, counted, merged into the head's tree."""

import math

import pytest
import torch

import modeling_jetspec.steps as steps
from modeling_jetspec.continuations import (
    LookupRecord,
    NgramIndex,
    RowIndexes,
    chain_trie,
    continuation_trie,
    merge_children,
    trie_children,
)
from modeling_jetspec.tree import build_tree, lookup_logprobs, lookup_match, marginal_children
from jetspec.tiny import oracle_head, prompts, tiny_head, tiny_target

PRIOR = [[0.2, 0.1], [0.5, 0.3], [0.8, 0.6, 0.5]]
# "5 6 7" occurs three times; the first two continue "1 2 3 9" and "1 2 4 8"
LOOP = [5, 6, 7, 1, 2, 3, 9, 5, 6, 7, 1, 2, 4, 8, 5, 6, 7]


def test_trie_counts_every_earlier_continuation():
    trie, order = continuation_trie(LOOP, 4)
    assert order == 3
    assert trie[()] == {1: 2}
    assert trie[(1, 2)] == {3: 1, 4: 1}
    assert trie[(1, 2, 3)] == {9: 1} and trie[(1, 2, 4)] == {8: 1}
    # the single chain sees only the most recent continuation
    assert lookup_match(LOOP, 4) == ([1, 2, 4, 8], 3)


def test_trie_falls_back_to_shorter_orders_and_to_nothing():
    trie, order = continuation_trie([1, 2, 3, 4, 2], 3)
    assert order == 1 and trie == {(): {3: 1}, (3,): {4: 1}, (3, 4): {2: 1}}
    assert continuation_trie([1, 2, 3], 3) == ({}, 0)


def test_single_occurrence_scores_as_the_single_chain():
    sequence = [4, 5, 6, 7, 8, 4, 5, 6]
    trie, order = continuation_trie(sequence, 4)
    chain, chain_order = lookup_match(sequence, 4)
    assert order == chain_order
    children = trie_children(trie, PRIOR, order)
    expected = lookup_logprobs(PRIOR, order, len(chain))
    path = ()
    for token, lp in zip(chain, expected):
        lps, tokens, _ = children(path)
        assert tokens == [token] and math.isclose(lps[0], lp)
        path += (token,)


def test_branch_shares_split_the_survival_ratio():
    trie, order = continuation_trie(LOOP, 4)
    lps, tokens, _ = trie_children(trie, PRIOR, order)((1, 2))
    depth_lp = lookup_logprobs(PRIOR, order, 3)[2]
    assert sorted(tokens) == [3, 4]
    assert all(math.isclose(lp, depth_lp + math.log(0.5)) for lp in lps)
    # without a prior the most frequent child enters first (log-prob 0), as the unscored chain does
    lps, _, _ = trie_children(trie, None, order)(())
    assert lps == [0.0]


def test_merge_keeps_the_higher_score_and_sorted_order():
    head = marginal_children(torch.tensor([[-0.1, -2.0], [-0.5, -1.0]]), torch.tensor([[1, 7], [2, 3]]), torch.zeros(2))
    trie, order = continuation_trie(LOOP, 4)
    merged = merge_children(head, trie_children(trie, PRIOR, order))
    lps, tokens, _ = merged(())
    assert tokens == [1, 7] and math.isclose(
        lps[0], -0.1, rel_tol=1e-6
    )  # float32: the head's -0.1 beats the trie's log(0.8)
    lps, tokens, _ = merged((1,))
    assert tokens == [2, 3] and lps == sorted(lps, reverse=True)
    lps, tokens, _ = merged((1, 2))  # past the head's depths, only the trie proposes
    assert sorted(tokens) == [3, 4]


def test_trie_tree_holds_both_branches_where_the_chain_holds_one():
    """At equal budget the trie's tree contains both earlier endings; the single-chain tree only the latest."""
    never = marginal_children(torch.full((4, 1), -20.0), torch.full((4, 1), 99), torch.zeros(4))
    trie, order = continuation_trie(LOOP, 4)
    trie_tree = build_tree(merge_children(never, trie_children(trie, PRIOR, order)), budget=6, depth=4)
    chain, chain_order = lookup_match(LOOP, 4)
    chain_tree = build_tree(merge_children(never, trie_children(chain_trie(chain), PRIOR, chain_order)), 6, 4)
    assert {3, 4} <= set(trie_tree.tokens)
    assert 4 in chain_tree.tokens and 3 not in chain_tree.tokens


# ------------------------------------------------------------------------------------------ the record of a call
def test_record_counts_hits_misses_and_censors_past_the_committed_tokens():
    record = LookupRecord(prior_weight=4.0, decay=1.0)
    trie, order = continuation_trie(LOOP, 4)  # (1 2) then 3 or 4
    record.offer(0, trie, order, len(LOOP))
    record.observe(0, LOOP + [1, 2, 4])  # three committed tokens, all along the trie: hits, nothing censored yet
    assert record.counts[(0, 3)] == ([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    record.offer(0, trie, order, len(LOOP))
    record.observe(0, LOOP + [1, 5, 4])  # leaves the trie at depth 2: one hit, one miss, depth 3 unknown
    assert record.counts[(0, 3)] == ([2.0, 1.0, 1.0], [2.0, 2.0, 1.0])
    record.observe(0, LOOP + [1, 2])  # nothing offered since: nothing counted
    assert record.counts[(0, 3)] == ([2.0, 1.0, 1.0], [2.0, 2.0, 1.0])


def test_record_raises_a_followed_branch_and_lowers_a_missed_one():
    prior = [[0.2, 0.1], [0.5, 0.3], [0.8, 0.4, 0.2]]
    chain = [1, 2, 3, 4]
    followed, missed = LookupRecord(decay=0.5), LookupRecord(decay=0.5)
    for _ in range(3):
        followed.offer(0, chain_trie(chain), 3, 10)
        followed.observe(0, [0] * 10 + chain)
        missed.offer(0, chain_trie(chain), 3, 10)
        missed.observe(0, [0] * 10 + [9])
    base = lookup_logprobs(prior, 3, 4)
    up = lookup_logprobs(followed.prior(0, prior, 3, 4), 3, 4)
    down = lookup_logprobs(missed.prior(0, prior, 3, 4), 3, 4)
    assert all(u > b for u, b in zip(up[1:], base[1:])) and up[0] > base[0]
    assert down[0] < base[0] and down[1:] == pytest.approx(base[1:])  # only depth 1 was ever tried
    assert followed.prior(0, prior, 3, 4)[:2] == prior[:2]  # other orders untouched
    assert LookupRecord().prior(5, prior, 3, 4) is prior  # a row without a record keeps the prior


# ------------------------------------------------------------------------------------ lossless inside generate
def greedy(target, ids, mask, **kwargs):
    return target.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kwargs)


LOSSLESS = [
    (arch, mode, batch) for arch in ("llama", "qwen3") for mode in ("never", "always", "sometimes") for batch in (1, 3)
]


@pytest.mark.parametrize("arch,mode,batch", LOSSLESS, ids=[f"{a}-{m}-bs{b}" for a, m, b in LOSSLESS])
@pytest.mark.parametrize("record", [False, True])
def test_trie_branch_is_lossless_with_oracle_drafters(arch, mode, batch, record):
    """(a) never: every committed non-bonus token comes from the trie; (b) always: the head fills every path;
    (c) sometimes: accepted paths run through later siblings. Left-padded batches of ragged prompts that repeat
    their last 5 tokens twice with a different token between, so the trie holds several continuations."""
    target = tiny_target(arch)
    ids, mask = prompts(batch)
    ids = torch.cat([ids, ids[:, -5:], torch.full((batch, 1), 7), ids[:, -5:]], dim=1)
    mask = torch.cat([mask, mask[:, -5:], torch.ones(batch, 1, dtype=torch.long), mask[:, -5:]], dim=1)
    plain = greedy(target, ids, mask, max_new_tokens=24)
    head = oracle_head(
        target,
        plain,
        mask,
        mode=mode,
        tree_lookup=6,
        tree_lookup_branches="trie",
        tree_lookup_prior=PRIOR,
        tree_lookup_record=record,
        tree_budget=10,
    )
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=24, assistant_model=head), plain)


def test_trie_branch_is_lossless_with_a_random_head_and_no_prior():
    target = tiny_target("llama")
    ids, mask = prompts(3)
    ids, mask = torch.cat([ids, ids[:, -6:], ids[:, -6:]], dim=1), torch.cat([mask, mask[:, -6:], mask[:, -6:]], 1)
    plain = greedy(target, ids, mask, max_new_tokens=24)
    for budget in (1, 8, 30):
        head = tiny_head(target, tree_budget=budget, tree_lookup=12, tree_lookup_branches="trie")
        assert torch.equal(greedy(target, ids, mask, max_new_tokens=24, assistant_model=head), plain), budget


def _bigram_target(arch):
    """A target whose layers add nothing (attention and MLP outputs zeroed): its next token is f(last token)."""
    target = tiny_target(arch)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        f = target(input_ids=torch.arange(128)[:, None]).logits[:, -1].argmax(-1).tolist()
    return target, f


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_trie_commits_an_earlier_continuation_the_chain_misses(arch, monkeypatch):
    """The prompt ends with "a b", so the first round's anchor is c = f(b) and "a b c" is the matched trigram. It
    occurs three times before: continued by decoys, by the target's own greedy continuation f(c) f(f(c)) ..., and
    (most recently) by other decoys. The never-right head proposes nothing the target accepts, so every committed
    non-bonus token comes from the model-free branch: the single chain (the latest continuation) misses in the
    first round, the trie holds all three and commits the right one."""
    target, f = _bigram_target(arch)
    a, b = next((a, b) for a in range(1, 128) for b in range(1, 128) if len({a, b, f[b]}) == 3)
    c = f[b]
    right = [f[c]]
    while len(right) < 6:
        right.append(f[right[-1]])
    decoys = [t for t in range(1, 128) if t not in right and t not in (a, b, c)]
    ids = torch.tensor([[a, b, c] + decoys[:4] + [a, b, c] + right + [a, b, c] + decoys[4:8] + [a, b]])
    mask = torch.ones_like(ids)
    plain = greedy(target, ids, mask, max_new_tokens=16)
    assert plain[0, ids.shape[1] :].tolist()[:7] == [c] + right
    built = []
    original = steps.build_tree
    monkeypatch.setattr(steps, "build_tree", lambda *args, **kw: built.append(original(*args, **kw)) or built[-1])
    prior = [[0.3], [0.5], [0.9]]
    accepted, first = {}, {}
    for branches in ("chain", "trie"):
        built.clear()
        head = oracle_head(
            target,
            plain,
            mask,
            mode="never",
            tree_lookup=6,
            tree_lookup_branches=branches,
            tree_lookup_prior=prior,
            tree_budget=16,
        )
        assert torch.equal(greedy(target, ids, mask, max_new_tokens=16, assistant_model=head), plain)
        stats = head.last_stats
        accepted[branches] = stats.round_tokens - stats.row_rounds  # non-bonus tokens: all from the branch
        tree = built[0]
        first[branches] = {t for t, d in zip(tree.tokens, tree.depths) if d == 1}
        # the nodes the branch added in round 1: every node on a path of the prompt's three continuations
        continuations = [decoys[:4] + [a, b], right, decoys[4:8] + [a, b]]  # 6 tokens each
        paths = {tuple(cont[:k]) for cont in continuations for k in range(1, 7)}
        node_paths = [()]
        for t, p in zip(tree.tokens, tree.parents):
            node_paths.append(node_paths[p] + (t,))
        first[branches + "_nodes"] = sum(1 for path in node_paths[1:] if path in paths)
    assert right[0] in first["trie"] and decoys[0] in first["trie"] and decoys[4] in first["trie"]
    assert right[0] not in first["chain"] and decoys[4] in first["chain"]
    # every node of the trie's tree is on an earlier continuation (they outscore the never-right head's); the chain
    # adds its 6 tokens and the head fills the rest of the budget
    assert first["trie_nodes"] == 16 and first["chain_nodes"] == 6
    assert accepted["trie"] > accepted["chain"] > 0


def test_branch_arguments_are_checked_by_name_and_saved(tmp_path):
    target = tiny_target("llama")
    ids, mask = prompts(1)
    head = tiny_head(
        target, tree_lookup=4, tree_lookup_branches="trie", tree_lookup_prior=PRIOR, tree_lookup_record=True
    )
    head.config.save_pretrained(tmp_path)
    saved = type(head.config).from_pretrained(tmp_path)
    assert (saved.tree_lookup_branches, saved.tree_lookup_record) == ("trie", True)
    with pytest.raises(ValueError, match="tree_lookup_branches in .'chain', 'trie'., got 'tries'"):
        greedy(target, ids, mask, max_new_tokens=4, assistant_model=head, tree_lookup_branches="tries")
    with pytest.raises(ValueError, match="tree_lookup_record True or False, got 1"):
        greedy(target, ids, mask, max_new_tokens=4, assistant_model=head, tree_lookup_record=1)
    with pytest.raises(ValueError, match="expected a tree_lookup_prior with tree_lookup_record=True"):
        greedy(target, ids, mask, max_new_tokens=4, assistant_model=head, tree_lookup_prior=False)
    with pytest.raises(ValueError, match="tree_lookup_branches"):
        tiny_head(target, tree_lookup_branches="suffix")


# ------------------------------------------------------------------------------------------------ incremental index
def scan_trie(sequence: list, length: int, max_ngram: int = 3, max_occurrences: int = 64):
    """The oracle: the scan of the whole history every round that the index replaced."""
    from collections import Counter

    total = len(sequence)
    for n in range(min(max_ngram, total - 1), 0, -1):
        suffix = sequence[total - n :]
        starts = [s for s in range(total - n - 1, -1, -1) if sequence[s : s + n] == suffix][:max_occurrences]
        if not starts:
            continue
        trie: dict = {}
        for start in starts:
            follow = sequence[start + n : start + n + length]
            for depth, token in enumerate(follow):
                trie.setdefault(tuple(follow[:depth]), Counter())[token] += 1
        return trie, n
    return {}, 0


def as_ordered(trie: dict) -> list:
    """A trie with its insertion orders (they break ties between equal counts in `most_common`)."""
    return [(path, list(counts.items())) for path, counts in trie.items()]


def histories_for_index(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    random = torch.randint(0, 12, (300,), generator=g).tolist()  # short repeats everywhere
    loop = ([5, 6, 7, 1, 2, 3, 9] * 30)[:200] + [5, 6, 7, 1, 2, 4, 8] * 10  # a loop that ends differently
    wide = torch.randint(0, 1000, (200,), generator=g).tolist()  # few matches, often none
    runs = [7] * 150 + [7, 8] * 40  # one token repeated: more occurrences than max_occurrences
    return [random, loop, wide, runs]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("max_ngram,max_occurrences", [(3, 64), (1, 64), (4, 5)])
def test_index_gives_the_scan_trie_and_chain_at_every_length(seed, max_ngram, max_occurrences):
    """Fed in uneven steps (as rounds commit 1..k tokens), the index's trie and chain equal the scan's, insertion
    order included, after every step."""
    steps = torch.Generator().manual_seed(seed + 10)
    for history in histories_for_index(seed):
        rows = RowIndexes()
        committed, at = [], 0
        while at < len(history):
            k = int(torch.randint(1, 9, (1,), generator=steps))
            committed += history[at : at + k]  # the same list grows, as Call.history does
            at += k
            index = rows.updated(0, committed, max_ngram)
            for length in (1, 6):
                trie, order = index.trie(length, max_occurrences)
                expected, expected_order = scan_trie(committed, length, max_ngram, max_occurrences)
                assert order == expected_order and as_ordered(trie) == as_ordered(expected), (len(committed), length)
                assert index.chain(length) == lookup_match(committed, length, max_ngram)
        assert continuation_trie(committed, 6, max_ngram) == scan_trie(committed, 6, max_ngram)


def test_index_rebuilds_for_a_history_it_did_not_index():
    rows = RowIndexes()
    rows.updated(0, [1, 2, 3, 1, 2], 3)
    other = [4, 4, 4, 4]  # not an extension of what row 0 indexed
    assert rows.updated(0, other, 3).trie(3) == scan_trie(other, 3)
    assert rows.updated(0, other, 2).trie(3) == scan_trie(other, 3, 2)  # another order: rebuilt
    with pytest.raises(ValueError, match="max_ngram to be an integer >= 1, got 0"):
        NgramIndex(0)


def test_round_host_time_does_not_grow_with_the_history():
    """A round's update (one round's committed tokens) and trie query on a history of 8,192 tokens costs about what
    it costs on 256 (the scan it replaced grew ~30x). Medians of many rounds; the ratio has generous slack, so a
    loaded machine does not fail it, while any per-round work proportional to the history would."""
    import time

    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, 50, (8192 + 4000,), generator=g).tolist()  # a small vocabulary: many matches

    def per_round(history_length: int) -> float:
        index = NgramIndex(3).update(text[:history_length])
        committed = text[:history_length]
        times = []
        for r in range(400):
            committed += text[history_length + 3 * r : history_length + 3 * r + 3]  # 3 tokens a round
            started = time.perf_counter()
            index.update(committed)
            index.trie(8)
            times.append(time.perf_counter() - started)
        return sorted(times)[len(times) // 2]

    per_round(256)  # warm
    short, long = per_round(256), per_round(8192)
    assert long < 3.0 * short, (short, long)
