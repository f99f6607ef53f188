"""The answer cache (`modeling_jetspec/answer_cache.py`): earlier calls' answers as one more source of the best-first
tree, beside the head, the prompt-lookup chain and the row's own continuation trie.

Lossless settings (tiny random targets, fp32), each against plain greedy, token for token:
  (a) an empty cache: the call drafts as without one, and fills it;
  (b) the right answers cached: a never-right head, so every committed non-bonus token the row's own trie does not
      give comes from the cache, and the second identical call takes far fewer target forwards;
  (c) wrong answers cached: the right answers with every third token changed, so the cache matches the rows' n-grams
      and drafts continuations the target rejects part-way.
"""

import math
import threading

import pytest
import torch
from test_hybrid import hybrid_target

import modeling_jetspec.steps as steps
from modeling_jetspec import AnswerCache
from modeling_jetspec.calibration import BINS, calibrated_logprob, check_calibration, node_source
from modeling_jetspec.continuations import RowIndexes, trie_children
from modeling_jetspec.tree import lookup_logprobs
from jetspec.tiny import oracle_head, prompts, tiny_head, tiny_target

PRIOR = [[0.2, 0.1], [0.5, 0.3], [0.8, 0.6, 0.5]]
NEW = 24


def greedy(target, ids, mask, **kwargs):
    return target.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kwargs)


# ------------------------------------------------------------------------------------------------ the cache itself
def test_trie_counts_every_continuation_most_recent_first():
    cache = AnswerCache()
    cache.add([5, 6, 7, 1, 2, 3])
    cache.add(torch.tensor([9, 6, 7, 1, 2, 4, 6, 7, 8]))
    trie, order = cache.trie([40, 41, 6, 7], 3)
    assert order == 2  # "41 6 7" occurs nowhere, "6 7" three times
    assert trie[()] == {1: 2, 8: 1}
    assert trie[(1,)] == {2: 2} and trie[(1, 2)] == {3: 1, 4: 1}
    # the most recent occurrences first: one read is the newest answer's last "6 7"
    assert cache.trie([6, 7], 3, max_occurrences=1) == ({(): {8: 1}}, 2)
    assert cache.trie([6, 7, 1], 2, max_ngram=1)[1] == 1
    assert cache.trie([99], 3) == ({}, 0)
    assert cache.trie([2, 4, 6, 7, 8], 3) == ({}, 0)  # an answer's last tokens continue nothing


def test_bounds_evict_the_oldest_answers_and_their_occurrences():
    cache = AnswerCache(max_answers=2, max_tokens=10)
    cache.add([1, 2, 3, 4])
    cache.add([2, 3, 5])
    cache.add([2, 3, 6])  # the third answer evicts the first
    assert cache.answers() == [[2, 3, 5], [2, 3, 6]] and (len(cache), cache.tokens) == (2, 6)
    assert cache.trie([2, 3], 2)[0] == {(): {5: 1, 6: 1}}
    assert cache.trie([3, 4], 2) == ({}, 0)  # evicted with its answer
    cache.add([7, 8, 9, 2, 3, 1])  # 6 tokens: the oldest is evicted so that 10 are not exceeded
    assert cache.answers() == [[2, 3, 6], [7, 8, 9, 2, 3, 1]] and cache.tokens == 9
    cache.add(list(range(20, 40)))  # longer than max_tokens: its first 10 tokens, alone
    assert cache.answers() == [list(range(20, 30))]
    assert cache.trie([28], 3) == ({(): {29: 1}}, 1)
    cache.add([3])  # continues nothing: not kept
    assert len(cache) == 1
    cache.clear()
    assert (len(cache), cache.tokens, cache.answers()) == (0, 0, [])
    assert cache.trie([28], 3) == ({}, 0)


def test_index_after_many_evictions_equals_a_fresh_one():
    g = torch.Generator().manual_seed(0)
    answers = [torch.randint(1, 6, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g) for _ in range(60)]
    cache = AnswerCache(max_answers=7, max_tokens=90)
    for answer in answers:
        cache.add(answer)
    fresh = AnswerCache(max_answers=7, max_tokens=90)
    for answer in cache.answers():
        fresh.add(answer)
    assert fresh.answers() == cache.answers() and fresh.tokens == cache.tokens <= 90 and len(cache) <= 7
    for a in range(1, 6):
        for b in range(1, 6):
            for c in range(1, 6):
                assert cache.trie([a, b, c], 4, max_occurrences=5) == fresh.trie([a, b, c], 4, max_occurrences=5)


def test_threads_share_one_cache():
    cache = AnswerCache(max_answers=50, max_tokens=400)

    def work(seed: int):
        for k in range(40):
            cache.add([seed, k % 7, (k + seed) % 5, 1, 2])
            cache.trie([k % 7, 1, 2], 4)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    held = cache.answers()
    assert len(held) == 50 and cache.tokens == sum(map(len, held)) == 250
    fresh = AnswerCache(max_answers=50, max_tokens=400)
    for answer in held:
        fresh.add(answer)
    assert all(cache.trie([k, 1, 2], 4) == fresh.trie([k, 1, 2], 4) for k in range(7))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(max_answers=0), "max_answers to be an integer >= 1, got 0"),
        (dict(max_tokens=2.5), "max_tokens to be an integer >= 1, got 2.5"),
        (dict(max_answers=True), "max_answers to be an integer >= 1, got True"),
    ],
)
def test_bad_bounds_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AnswerCache(**kwargs)


@pytest.mark.parametrize(
    "token_ids,message",
    [
        (torch.ones(2, 3, dtype=torch.long), r"1-D integer tensor, got shape \(2, 3\)"),
        (torch.ones(3), "1-D integer tensor, got shape"),
        ("abc", "list of ints or a 1-D tensor, got str"),
        ([1, -2, 3], r"integers >= 0, got \[-2\]"),
        ([1, 2.0], r"integers >= 0, got \[2.0\]"),
    ],
)
def test_bad_answers_are_refused(token_ids, message):
    cache = AnswerCache()
    with pytest.raises(ValueError, match=message):
        cache.add(token_ids)
    assert len(cache) == 0


# ------------------------------------------------------------------------------------------------ scores and sources
def test_answers_are_scored_as_the_rows_own_trie():
    cache = AnswerCache()
    cache.add([4, 5, 6, 7, 8])
    trie, prior, order = RowIndexes(answers=cache).answer_branch([1, 4, 5, 6], 2, PRIOR)
    assert (trie, prior, order) == ({(): {7: 1}, (7,): {8: 1}}, PRIOR, 3)
    lps, tokens, _ = trie_children(trie, prior, order)((7,))
    assert tokens == [8] and math.isclose(lps[0], lookup_logprobs(PRIOR, 3, 2)[1])
    assert RowIndexes().answer_branch([1, 4, 5, 6], 2, PRIOR) == ({}, None, 0)


def test_answers_are_their_own_source_mapped_as_lookup_until_fitted():
    head_tokens, trie, answers = [[1, 2]], {(): {2: 1, 3: 1}}, {(): {2: 1, 3: 1, 4: 1}}
    sources = [node_source(head_tokens, trie, (), t, answers=answers) for t in (1, 2, 3, 4)]
    assert sources == ["head", "both", "lookup", "answers"]
    assert node_source(head_tokens, trie, (), 4) == "head"  # without the answers trie, as before
    table = {"1:lookup": [0.05 * (b + 1) for b in range(BINS)]}
    assert math.isclose(calibrated_logprob(table, 1, "answers", math.log(0.55)), math.log(0.3))
    table["1:answers"] = [0.9] * BINS
    assert check_calibration(table) is table
    assert math.isclose(calibrated_logprob(table, 1, "answers", math.log(0.55)), math.log(0.9))
    assert calibrated_logprob(table, 2, "answers", -0.7) == -0.7  # no map at that depth: the raw score


# ------------------------------------------------------------------------------------------------ inside generate
def _wrong(answers: list) -> list:
    """Each answer with every third token changed: its n-grams still match, its continuations go astray."""
    return [[(t + 1) % 128 if k % 3 == 2 else t for k, t in enumerate(answer)] for answer in answers]


def _filled(kind: str, plain, prompt_length: int) -> AnswerCache:
    cache = AnswerCache()
    right = [row[prompt_length:].tolist() for row in plain]
    for answer in {"empty": [], "right": right, "wrong": _wrong(right)}[kind]:
        cache.add(answer)
    return cache


CASES = [(arch, batch, kind) for arch in ("llama", "qwen3") for batch in (1, 3) for kind in ("empty", "right", "wrong")]


@pytest.mark.parametrize("arch,batch,kind", CASES, ids=[f"{a}-bs{b}-{k}" for a, b, k in CASES])
def test_answers_are_lossless(arch, batch, kind):
    target = tiny_target(arch)
    ids, mask = prompts(batch)
    plain = greedy(target, ids, mask, max_new_tokens=NEW)
    for head in (
        oracle_head(
            target, plain, mask, mode="never", tree_lookup=6, tree_lookup_branches="trie", tree_lookup_prior=PRIOR
        ),
        tiny_head(target, tree_lookup=6, tree_budget=8),  # a random head, the chain, no prior: the answers first
    ):
        cache = _filled(kind, plain, ids.shape[1])
        assert torch.equal(
            greedy(target, ids, mask, max_new_tokens=NEW, assistant_model=head, jetspec_answer_cache=cache), plain
        )


def test_right_answer_cached_takes_far_fewer_forwards():
    """(b) The same call twice with a never-right head: the first fills the cache, the second drafts from it."""
    target = tiny_target("llama")
    ids, mask = prompts(1)
    plain = greedy(target, ids, mask, max_new_tokens=32)
    head = oracle_head(
        target,
        plain,
        mask,
        mode="never",
        tree_lookup=8,
        tree_lookup_branches="trie",
        tree_lookup_prior=PRIOR,
        tree_budget=12,
    )
    cache, forwards, sources = AnswerCache(), [], []
    for _ in range(2):
        assert torch.equal(
            greedy(target, ids, mask, max_new_tokens=32, assistant_model=head, jetspec_answer_cache=cache), plain
        )
        forwards.append(head.last_stats.target_forwards)
        sources.append(head.last_stats.token_sources[0])
    assert cache.answers() == [plain[0, ids.shape[1] :].tolist()] * 2
    assert forwards[1] * 3 <= forwards[0], forwards  # 32 tokens in 8-token chains: a handful of forwards, not ~30
    # the round records the tokens the cache alone proposed as "answers" (the never-right head proposes none)
    assert "answers" not in sources[0] and sources[1].count("answers") >= 16, sources
    assert len(sources[1]) == 32 and "head" not in sources[1] and "both" not in sources[1]


def test_each_row_adds_its_own_new_tokens():
    """Rows stopping apart on an EOS: each row's answer ends where its output does (its EOS), no padding."""
    target = tiny_target("llama")
    ids, mask = prompts(3)
    free = greedy(target, ids, mask, max_new_tokens=NEW)
    eos = int(free[2, ids.shape[1] + 5])
    plain = greedy(target, ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    cache = AnswerCache()
    head = tiny_head(target, tree_lookup=4)
    tree = greedy(
        target,
        ids,
        mask,
        max_new_tokens=NEW,
        eos_token_id=eos,
        pad_token_id=0,
        assistant_model=head,
        jetspec_answer_cache=cache,
    )
    assert torch.equal(tree, plain)
    expected = []
    for row in plain[:, ids.shape[1] :].tolist():
        expected.append(row[: row.index(eos) + 1] if eos in row else row)
    assert cache.answers() == expected and len({len(a) for a in expected}) > 1


def test_static_path_is_lossless_with_answers():
    target = tiny_target("llama")
    ids, mask = prompts(3)
    plain = greedy(target, ids, mask, max_new_tokens=NEW)
    for kind in ("right", "wrong"):
        # a tree too small for the answers' trie alone: the static node count makes room for it
        head = tiny_head(target, tree_depth=1, tree_width=1, tree_budget=40, tree_lookup=5)
        cache = _filled(kind, plain, ids.shape[1])
        out = greedy(
            target,
            ids,
            mask,
            max_new_tokens=NEW,
            assistant_model=head,
            jetspec_answer_cache=cache,
            jetspec_static="eager",
        )
        assert torch.equal(out, plain), kind


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_hybrid_target_is_lossless_with_answers(mode):
    """A convolution-layer target (LFM2) under both hybrid verifiers, with each cache; the right answers cached
    take fewer target forwards than none."""
    target = hybrid_target("lfm2")
    ids, mask = prompts(3)
    plain = greedy(target, ids, mask, max_new_tokens=16)
    head = oracle_head(
        target, plain, mask, mode="never", tree_lookup=6, tree_lookup_branches="trie", tree_lookup_prior=PRIOR
    )
    forwards = {}
    for kind in ("empty", "right", "wrong"):
        cache = _filled(kind, plain, ids.shape[1])
        out = greedy(
            target, ids, mask, max_new_tokens=16, assistant_model=head, jetspec_answer_cache=cache, tree_verify=mode
        )
        assert torch.equal(out, plain), kind
        forwards[kind] = head.last_stats.target_forwards
    assert forwards["right"] < forwards["empty"], forwards


def test_first_tree_holds_the_cached_answer(monkeypatch):
    """The answers' nodes enter the tree beside the head's: with the right answer cached and a never-right head,
    the first round's tree holds the answer's next tokens as a chain under the root."""
    target = tiny_target("llama")
    ids, mask = prompts(1)
    plain = greedy(target, ids, mask, max_new_tokens=16)
    answer = plain[0, ids.shape[1] :].tolist()
    built = []
    original = steps.build_tree
    monkeypatch.setattr(steps, "build_tree", lambda *args, **kw: built.append(original(*args, **kw)) or built[-1])
    head = oracle_head(target, plain, mask, mode="never", tree_lookup=6, tree_lookup_prior=PRIOR, tree_budget=12)
    cache = AnswerCache()
    cache.add(answer)
    greedy(target, ids, mask, max_new_tokens=16, assistant_model=head, jetspec_answer_cache=cache)
    tree, path = built[0], [()]
    for token, parent in zip(tree.tokens, tree.parents):
        path.append(path[parent] + (token,))
    # the anchor is answer[0]; its only earlier occurrence in the answers is at their start
    assert tuple(answer[1:7]) in path


def test_bad_cache_arguments_are_refused():
    target = tiny_target("llama")
    ids, mask = prompts(1)
    head = tiny_head(target, tree_lookup=4)
    with pytest.raises(ValueError, match="expected jetspec_answer_cache to be an AnswerCache or None, got list"):
        greedy(target, ids, mask, max_new_tokens=4, assistant_model=head, jetspec_answer_cache=[1, 2])
    with pytest.raises(ValueError, match="expected tree_lookup >= 1 with jetspec_answer_cache"):
        greedy(
            target, ids, mask, max_new_tokens=4, assistant_model=head, jetspec_answer_cache=AnswerCache(), tree_lookup=0
        )


# ------------------------------------------------------------------------------------------------ the bench's method
def test_bench_method_shares_one_cache_across_the_prompts(monkeypatch, tmp_path):
    """`jetspec bench`'s `answers` method: the head's defaults and one cache over the run's prompts, empty after the
    warm-up; every output is plain greedy's (the bench checks it)."""
    from test_bench import char_tokenizer, tiny_pair

    from jetspec.bench import BenchConfig, run_benchmark

    target, head = tiny_pair()
    held = []  # answers in the cache at each call with one
    original = target.generate

    def generate(*args, **kwargs):
        cache = kwargs.get("jetspec_answer_cache")
        if cache is not None and "custom_generate" not in kwargs:
            held.append(len(cache))
        return original(*args, **kwargs)

    monkeypatch.setattr(target, "generate", generate)
    config = BenchConfig(["repeated"], [4], 8, limit=3, methods=["plain", "answers"], cost_repeats=1)
    results = run_benchmark(target, char_tokenizer(), head, config, tmp_path, command="pytest", progress=False)
    assert held == [0, 0, 1, 2]  # the warm-up, then each prompt with the answers of the ones before it
    assert results["config"]["method_arguments"]["answers"] == {"tree_lookup": 6}
    assert [r["method"] for r in results["prompts"]].count("answers") == 3
    assert all(r["equality"] == "exact" for r in results["prompts"])


def test_calibration_map_ranks_the_answers_nodes():
    """Under a calibration map, the answers' nodes are ranked by the map's "answers" rates: mapped to acceptance 0
    they lose the budget to the never-right head's nodes (mapped to 0.01) and the call runs about as many forwards as
    without the cache; mapped to 1 they lead the tree."""
    target = tiny_target("llama")
    ids, mask = prompts(1)
    plain = greedy(target, ids, mask, max_new_tokens=24)
    forwards = {}
    for rate in (0.0, 1.0):
        table = {f"{d}:{source}": [r] * BINS for d in range(1, 9) for source, r in (("head", 0.01), ("answers", rate))}
        head = oracle_head(target, plain, mask, mode="never", tree_lookup=8, tree_lookup_prior=PRIOR)
        cache = _filled("right", plain, ids.shape[1])
        out = greedy(
            target,
            ids,
            mask,
            max_new_tokens=24,
            assistant_model=head,
            jetspec_answer_cache=cache,
            tree_calibration=table,
        )
        assert torch.equal(out, plain)
        forwards[rate] = head.last_stats.target_forwards
    assert forwards[1.0] * 3 <= forwards[0.0], forwards
