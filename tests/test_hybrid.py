"""Hybrid targets (linear-attention or convolution layers next to attention layers) decode losslessly with both
verifiers of `modeling_jetspec/hybrid.py`: "chain" (the best path in one forward, recorded convolution states cut
back, recurrent rows replayed) and "tree" (every root-to-leaf path in one forward, a batch row per leaf, then one
fold of the committed tokens into the rows' states), and with "auto", which chooses one of the two per round.

Settings, bracketing acceptance (tiny random Qwen3.5 dense and MoE, Qwen3-Next and LFM2 targets, fp32):
  (a) a random untrained head: drafts mostly wrong;
  (b) an always-right drafter: every round commits depth + 1 tokens in either mode, and the forwards are counted;
  (c) a sometimes-right drafter: the right token is the head's 1st, 2nd or 3rd candidate depending on the position,
      so chains are cut short (recurrent states replayed) and trees accept through later siblings (a non-first
      child's states become the row's);
  (d) sampling with logits processors: a chi-square test against the exact distribution, as in `test_sampling.py`.
"""

import pytest
import torch
from test_architectures import HYBRID_FAMILIES, VOCAB, family_target
from test_lossless import LookupBranch
from test_sampling import ALPHA, NEW, MarginalHead, exact_distribution, goodness_of_fit, sample
from jetspec.tiny import oracle_head, prompts, tiny_head, tiny_target

from modeling_jetspec import hybrid_tree
from modeling_jetspec.hybrid import HybridVerifier
from modeling_jetspec.hybrid_cache import HybridForwards
from modeling_jetspec.hybrid_tree import TreeRounds, fold_length, leaf_paths
from modeling_jetspec.state import JetSpecStats, TreeShape
from modeling_jetspec.verifiers import measure_verify_seconds

FAMILIES = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "lfm2"]
MODES = ["chain", "tree"]


def hybrid_target(family: str, **extra):
    overrides, attention = HYBRID_FAMILIES[family]
    return family_target(family, {**overrides, **extra}, attention)


def greedy(target, ids, mask, **kwargs):
    return target.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kwargs)


class ForwardCount:
    """Counts the target's forward calls (prefill, verify, replay and scan steps alike)."""

    def __init__(self, target):
        self.calls = 0
        self.handle = target.register_forward_hook(self.hook)

    def hook(self, *args):
        self.calls += 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch", [1, 3])
def test_random_head_matches_greedy(family, mode, batch):  # (a)
    target = hybrid_target(family)
    ids, mask = prompts(batch, vocab_size=VOCAB)
    free = greedy(target, ids, mask, max_new_tokens=16)
    eos = int(free[batch - 1, ids.shape[1] + 6])  # rows stop at different rounds
    plain = greedy(target, ids, mask, max_new_tokens=16, eos_token_id=eos)
    tree = greedy(
        target, ids, mask, max_new_tokens=16, eos_token_id=eos, assistant_model=tiny_head(target), tree_verify=mode
    )
    assert torch.equal(tree, plain)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_always_right_drafter_commits_whole_paths(family, mode):  # (b)
    target = hybrid_target(family)
    ids, mask = prompts(3, vocab_size=VOCAB)
    plain = greedy(target, ids, mask, max_new_tokens=13)
    head = oracle_head(target, plain, mask, mode="always", tree_depth=3)
    count = ForwardCount(target)
    tree = greedy(target, ids, mask, max_new_tokens=13, assistant_model=head, tree_verify=mode)
    assert torch.equal(tree, plain)
    assert head.last_stats.tau == 4.0 and head.last_stats.rounds == 3  # 1 from the prefill, 3 rounds of 3 + bonus
    # one forward per round in either mode: the chain has nothing to replay; the tree's accepted path is a whole
    # root-to-leaf path that no padding followed in its forward, so the rows keep that forward's states
    assert count.calls == 1 + 3


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch", [1, 3])
def test_sometimes_right_drafter_matches_greedy(family, mode, batch):  # (c)
    target = hybrid_target(family)
    ids, mask = prompts(batch, vocab_size=VOCAB)
    plain = greedy(target, ids, mask, max_new_tokens=24)
    head = oracle_head(target, plain, mask, mode="sometimes", tree_depth=4, tree_width=3, tree_budget=30)
    tree = greedy(target, ids, mask, max_new_tokens=24, assistant_model=head, tree_verify=mode)
    assert torch.equal(tree, plain)
    # the tree finds the right token among the first three candidates at every depth, the chain only at rank 0
    assert head.last_stats.tau > (3.0 if mode == "tree" else 1.2)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["qwen3_5_text", "lfm2"])
def test_stats_count_every_target_forward(family, mode):
    # (c) sometimes right, at batch 3: chains are cut short, so rows with recurrent states (Qwen3.5) are replayed;
    # a tree round runs its leaf paths, then folds. The statistics count the forwards the target really ran.
    target = hybrid_target(family)
    ids, mask = prompts(3, vocab_size=VOCAB)
    plain = greedy(target, ids, mask, max_new_tokens=24)
    head = oracle_head(target, plain, mask, mode="sometimes", tree_depth=4, tree_width=3, tree_budget=30)
    count = ForwardCount(target)
    out = greedy(
        target, ids, mask, max_new_tokens=24, assistant_model=head, tree_verify=mode, return_dict_in_generate=True
    )
    count.handle.remove()
    assert torch.equal(out.sequences, plain)
    stats = out.jetspec_stats
    assert stats.target_forwards == count.calls
    if mode == "chain" and family == "qwen3_5_text":  # replays: more forwards than prefill + rounds
        assert count.calls > 1 + stats.rounds
    if mode == "tree":  # the leaf paths, and a fold in the rounds whose accepted path was not a whole leaf path
        assert 1 + stats.rounds <= count.calls <= 1 + 2 * stats.rounds


@pytest.mark.parametrize("mode", MODES)
def test_lookup_branch_is_verified(mode, monkeypatch):
    # a prompt that repeats itself: the prompt-lookup chain leads the tree (no prior: chain first), so the chain
    # verifier's best path is the lookup branch; rows whose lookup chain differs in length are padded
    target = hybrid_target("qwen3_5_text")
    ids, mask = prompts(3, vocab_size=VOCAB)
    ids = torch.cat([ids, ids[:, -6:], ids[:, -6:]], dim=1)
    mask = torch.cat([mask, torch.ones(3, 12, dtype=mask.dtype)], dim=1)
    plain = greedy(target, ids, mask, max_new_tokens=20)
    head = tiny_head(target, tree_lookup=6)
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=20, assistant_model=head, tree_verify=mode), plain)
    # a never-right head: every token a round commits besides its bonus must be one the lookup branch drafted, and
    # there must be some, so the branch's nodes really went through the hybrid verifier and were accepted
    never = oracle_head(target, plain, mask, mode="never", tree_lookup=6)
    branch = LookupBranch(monkeypatch)
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=20, assistant_model=never, tree_verify=mode), plain)
    assert branch.added_nodes() > 0 and branch.accepted_nodes() > 0
    assert branch.accepted_outside_the_branch() == []
    assert never.last_stats.tau > 1.0  # a never-right head alone commits exactly 1 token per round


@pytest.mark.parametrize("mode", MODES)
def test_measured_budget_and_path_conditioning_stay_lossless(mode):
    # tree_budget="auto" times verify forwards and undoes each one (`discard`), before the first round
    target = hybrid_target("qwen3_next")
    ids, mask = prompts(3, vocab_size=VOCAB)
    plain = greedy(target, ids, mask, max_new_tokens=12)
    for kwargs in (dict(tree_budget="auto"), dict(path_conditioning=True)):
        tree = greedy(
            target, ids, mask, max_new_tokens=12, assistant_model=tiny_head(target), tree_verify=mode, **kwargs
        )
        assert torch.equal(tree, plain), kwargs


def test_tree_accepts_more_than_chain_in_as_few_forwards():
    """Counts, not times, behind `docs/targets.md`'s table."""
    target = hybrid_target("qwen3_5_text")
    ids, mask = prompts(1, vocab_size=VOCAB)
    plain = greedy(target, ids, mask, max_new_tokens=40)
    result = {}
    for mode in MODES:
        head = oracle_head(target, plain, mask, mode="sometimes", tree_depth=4, tree_width=3, tree_budget=30)
        count = ForwardCount(target)
        assert torch.equal(greedy(target, ids, mask, max_new_tokens=40, assistant_model=head, tree_verify=mode), plain)
        count.handle.remove()
        result[mode] = (head.last_stats.tau, head.last_stats.rounds, count.calls - 1)  # forwards after the prefill
    print(f"\n{'mode':>6} {'tau':>6} {'rounds':>7} {'forwards':>9} {'tokens/forward':>15}")
    for mode, (tau, rounds, forwards) in result.items():
        print(f"{mode:>6} {tau:6.2f} {rounds:7d} {forwards:9d} {39 / forwards:15.2f}")
    (chain_tau, chain_rounds, chain_forwards), (tree_tau, tree_rounds, tree_forwards) = result.values()
    assert tree_tau > chain_tau  # a tree accepts through later siblings, a chain stops at its first miss
    assert chain_rounds <= chain_forwards <= 2 * chain_rounds  # one verify, plus at most one replay at batch 1
    # the leaf paths every round, and a fold in the rounds whose accepted path was not a whole leaf path
    assert tree_rounds <= tree_forwards <= 2 * tree_rounds


class RoundForwards:
    """The target forwards of each round (`JetSpecStats.add_round`'s `forwards`), and its rows' accepted counts."""

    def __init__(self, monkeypatch):
        self.forwards, self.counts = [], []
        add_round = JetSpecStats.add_round

        def recording(stats, budget, counts, *args, forwards):
            self.forwards.append(forwards)
            self.counts.append(list(counts))
            return add_round(stats, budget, counts, *args, forwards=forwards)

        monkeypatch.setattr(JetSpecStats, "add_round", recording)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch", [1, 2])
def test_tree_round_costs_at_most_two_forwards(family, batch, monkeypatch):
    # forward 1 over the leaf paths, then at most one fold, whatever the tree's size and the rows' accepted lengths
    # (at batch 2 rows accept different lengths: the fold leaves a row some tokens, run first in its next round)
    target = hybrid_target(family)
    ids, mask = prompts(batch, vocab_size=VOCAB)
    free = greedy(target, ids, mask, max_new_tokens=20)
    answer = free[0, ids.shape[1] :].tolist()
    first = next((k for k in range(6, len(answer)) if answer[k] not in answer[:k]), None)
    kwargs = {"eos_token_id": answer[first]} if batch > 1 and first is not None else {}  # a row stops mid-answer
    plain = greedy(target, ids, mask, max_new_tokens=20, **kwargs)
    rounds = RoundForwards(monkeypatch)
    differ = 0
    for budget in (1, 5, 12, 30):
        shape = dict(tree_depth=4, tree_width=3, tree_budget=budget)
        for head in (tiny_head(target, **shape), oracle_head(target, plain, mask, mode="sometimes", **shape)):
            rounds.forwards.clear()
            tree = greedy(target, ids, mask, max_new_tokens=20, assistant_model=head, tree_verify="tree", **kwargs)
            assert torch.equal(tree, plain), budget
            assert rounds.forwards and max(rounds.forwards) <= 2, (budget, rounds.forwards)
            differ += sum(len(set(c)) > 1 for c in rounds.counts)
            rounds.counts.clear()
    if batch > 1:
        assert differ > 0  # some round's rows accepted different lengths


def test_tree_forward_runs_every_leaf_path_in_one_batch(monkeypatch):
    # one forward 1 per round holds a batch row per distinct leaf; a tiny `PATHS_FORWARD_BYTES` splits it into
    # chunks of as many paths as the batch has rows (more forwards, same tokens)
    target = hybrid_target("qwen3_5_text")
    ids, mask = prompts(2, vocab_size=VOCAB)
    plain = greedy(target, ids, mask, max_new_tokens=12)
    shapes = []
    paths_forward = TreeRounds.paths_forward

    def recording(self, state, paths, part):
        shapes.append(len(part))
        return paths_forward(self, state, paths, part)

    monkeypatch.setattr(TreeRounds, "paths_forward", recording)
    head = tiny_head(target, tree_depth=3, tree_width=3, tree_budget=12)
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=12, assistant_model=head, tree_verify="tree"), plain)
    assert max(shapes) > 2 * 3  # a 12-node tree of width 3 has more leaves than depths, in each of 2 rows
    rounds = len(shapes)
    shapes.clear()
    monkeypatch.setattr(hybrid_tree, "PATHS_FORWARD_BYTES", 1)
    monkeypatch.setattr(TreeRounds, "__init__", _small_weights(TreeRounds.__init__))
    head = tiny_head(target, tree_depth=3, tree_width=3, tree_budget=12)
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=12, assistant_model=head, tree_verify="tree"), plain)
    assert set(shapes) <= {1, 2} and 2 in shapes and len(shapes) > rounds


def _small_weights(init):
    def wrapped(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.weight_bytes = 0  # so that PATHS_FORWARD_BYTES alone bounds a forward

    return wrapped


def test_leaf_paths_read_the_past_in_place_and_cost_the_same_as_it_grows(monkeypatch):
    # forward 1's attention layers read the rows' past where it lies, not a copy per leaf: so what a leaf path counts
    # against the forward's bound (and how many paths one forward runs) hardly grows with the answer
    target = hybrid_target("qwen3_5_text")
    ids, mask = prompts(1, vocab_size=VOCAB)
    plain = greedy(target, ids, mask, max_new_tokens=150)
    counted, shared = [], []
    path_bytes, rows_cache = TreeRounds.path_bytes, HybridForwards.rows_cache

    def counting(self, state, length, slots):
        counted.append((state.valid.shape[1], length, slots, path_bytes(self, state, length, slots)))
        return counted[-1][-1]

    def sharing(self, state, rows, length, states):
        cache, layout, used = rows_cache(self, state, rows, length, states)
        for i in self.attention:
            past, main = cache.layers[i].past[0], state.cache.layers[i].keys
            shared.append(past.untyped_storage().data_ptr() == main.untyped_storage().data_ptr())
        return cache, layout, used

    monkeypatch.setattr(TreeRounds, "path_bytes", counting)
    monkeypatch.setattr(HybridForwards, "rows_cache", sharing)
    head = tiny_head(target, tree_depth=3, tree_width=3, tree_budget=12)
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=150, assistant_model=head, tree_verify="tree"), plain)
    assert len(shared) > 20 and all(shared)  # every forward over rows (leaf paths, folds) read the past in place
    first = counted[0]
    alike = [c for c in counted if c[1:3] == first[1:3]]  # paths of the same length, rows of as many leaves
    assert max(c[0] for c in alike) > 5 * first[0]  # the history grew
    assert max(c[3] for c in alike) <= 1.1 * first[3]  # what a path counts did not (its rows of the masks only)


def test_leaf_paths_read_every_node_from_a_path_holding_it():
    # root 0; 1 and 2 under the root; 3 under 1; 4 a copy of 3 (the padding of a shorter tree)
    plan = leaf_paths([5, 6, 7, 7], [0, 0, 1, 1])
    assert plan.paths == [[0, 2], [0, 1, 3]]
    assert plan.canonical == [0, 1, 2, 3, 3]
    for node, (path, depth) in enumerate(plan.source):
        assert plan.paths[path][depth] == plan.canonical[node]


def test_fold_length_keeps_few_tokens_unfolded():
    assert fold_length([5]) == 5  # batch 1: all of them
    assert fold_length([3, 8]) == 8  # folding 3 would leave 5, folding 8 leaves the other row's 3
    assert fold_length([4, 4, 2]) == 4


@pytest.mark.parametrize("family", ["qwen3_5_text", "lfm2"])
def test_auto_chooses_per_round_and_stays_lossless(family, monkeypatch):
    # "auto" times a chain verify and a tree verify once, explores trees, then runs the mode with the most expected
    # tokens per second; switching from a tree round to a chain round folds what a tree round left unfolded
    target = hybrid_target(family)
    ids, mask = prompts(2, vocab_size=VOCAB)
    plain = greedy(target, ids, mask, max_new_tokens=30)
    chosen = []
    verify = HybridVerifier._verify

    def recording(self, mode, state, trees):
        chosen.append(mode)
        return verify(self, mode, state, trees)

    monkeypatch.setattr(HybridVerifier, "_verify", recording)
    head = oracle_head(target, plain, mask, mode="sometimes", tree_depth=4, tree_width=3, tree_budget=30)
    count = ForwardCount(target)
    out = greedy(
        target, ids, mask, max_new_tokens=30, assistant_model=head, tree_verify="auto", return_dict_in_generate=True
    )
    count.handle.remove()
    assert torch.equal(out.sequences, plain)
    assert out.jetspec_stats.target_forwards == count.calls
    timed = [("tree_verify",) == key[:1] for key in head.verify_cost_cache[target]]
    assert any(timed)  # the two modes were timed, and kept on the head
    assert {"chain", "tree"} <= set(chosen)  # timing ran both


@pytest.mark.parametrize("mode", MODES)
def test_measured_verify_seconds_time_the_mode_they_price(mode, monkeypatch):
    target = hybrid_target("qwen3_5_text")
    head = tiny_head(target)
    ran = []
    verify = HybridVerifier._verify

    def recording(self, round_mode, state, trees):
        ran.append(round_mode)
        return verify(self, round_mode, state, trees)

    monkeypatch.setattr(HybridVerifier, "_verify", recording)
    shape = TreeShape(depth=3, width=2, budget=6, scoring="logprob", path_conditioning=False)
    seconds = measure_verify_seconds(target, head, shape, [2, 6], context_length=8, repeats=1, tree_verify=mode)
    assert set(seconds) == {2, 6} and all(s > 0 for s in seconds.values())
    assert set(ran) == {mode}


# family, mode, gain on the (tied) output embeddings: peaked enough that drafts are accepted often, flat enough
# that the 3-token continuations spread over 15-20 bins (at a larger gain some targets become deterministic)
SAMPLING = [
    ("qwen3_5_text", "chain", 40.0),
    ("qwen3_5_moe_text", "tree", 15.0),
    ("qwen3_next", "chain", 15.0),
    ("lfm2", "tree", 3.0),
]


@pytest.mark.parametrize("family,mode,gain", SAMPLING, ids=[f"{f}-{m}" for f, m, _ in SAMPLING])
def test_sampling_matches_the_exact_reference(family, mode, gain):  # (d)
    vocab = 8
    target = hybrid_target(family, vocab_size=vocab, pad_token_id=None)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(gain)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    probs = exact_distribution(target, prompt)
    head = MarginalHead.from_target(
        target, num_hidden_layers=1, block_size=4, tree_depth=2, tree_width=2, tree_budget=6
    ).eval()
    marginals = torch.full((NEW, vocab), 1e-9)
    for seq, p in probs.items():
        for d, token in enumerate(seq):
            marginals[d, token] += p
    head.marginals = marginals.log()
    torch.manual_seed(1)
    out = sample(target, prompt, assistant_model=head, tree_verify=mode)
    assert goodness_of_fit(out, probs) > ALPHA
    assert min(head.last_stats.acceptance_per_depth) > 0.2  # drafts were accepted at both depths


def test_tree_verify_is_checked():
    hybrid = hybrid_target("lfm2")
    ids, mask = prompts(1, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="tree_verify"):
        greedy(hybrid, ids, mask, max_new_tokens=4, assistant_model=tiny_head(hybrid), tree_verify="scan")
    attention = tiny_target("llama")
    with pytest.raises(ValueError, match="attention-only"):
        greedy(attention, ids, mask, max_new_tokens=4, assistant_model=tiny_head(attention), tree_verify="chain")
