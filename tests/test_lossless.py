"""The headline property: tree speculative decoding returns plain greedy's tokens, token for token (fp32).

Settings, bracketing acceptance:
  (a) a random untrained head: drafts are mostly wrong, occasionally right;
  (b) a never-right drafter: every round commits exactly the bonus token (tau == 1);
  (c) an always-right drafter (it knows the greedy continuation): every round commits depth + 1 tokens;
  (d) a sometimes-right drafter: the right token sits at rank 0, 1 or 2 of its distribution depending on the
      position, so accepted paths run through later siblings and their nodes are not contiguous in the tree.
"""

import pytest
import torch
from transformers.cache_utils import DynamicCache

import modeling_jetspec.decode as decode
import modeling_jetspec.integration as integration
import modeling_jetspec.steps as steps
import modeling_jetspec.tree as tree_module
from modeling_jetspec import JetSpecGenerateOutput
from jetspec.tiny import ARCHITECTURES, oracle_head, prompts, tiny_head, tiny_target

SHAPES = [  # (depth, width, budget)
    (1, 1, 1),
    (4, 3, 12),
    (7, 2, 24),
    (3, 8, 40),
]
CASES = [(arch, shape, batch) for arch in ARCHITECTURES for shape in SHAPES for batch in (1, 3)]


def greedy(target, ids, mask, **kwargs):
    return target.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kwargs)


class TargetForwards:
    """The target's forward calls, seen by a forward hook: how many rows each one read (prefill, verifies, and any
    scan or replay step alike). Measured from outside the loop, so tau and the forward count can be checked against
    what the target really ran rather than against the statistics' own arithmetic."""

    def __init__(self, target):
        self.rows = []
        self.handle = target.register_forward_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs, output):
        ids = kwargs["input_ids"] if kwargs.get("input_ids") is not None else args[0]
        self.rows.append(ids.shape[0])

    def remove(self):
        self.handle.remove()

    def tokens_per_verified_row(self, committed_by_rounds: int) -> float:
        """Tokens the rounds committed per row a verify forward read: tau, with one forward per round after the
        prefill."""
        return committed_by_rounds / sum(self.rows[1:])


def token_paths(tokens: torch.Tensor, parents: torch.Tensor, row: int) -> list:
    """The tokens from the root to each node of one row's tree, node order (index 0: the root's empty path)."""
    paths = [()]
    for token, parent in zip(tokens[row].tolist(), parents[row].tolist()):
        paths.append(paths[parent] + (token,))
    return paths


class LookupBranch:
    """What the prompt-lookup branch contributed to each round, recorded by wrapping the round's `draft` and `accept`
    (as `decode._round` calls them) and the chain each row's tree is offered (`steps.chain_trie`).

    `chains[r][i]`: the lookup chain offered to round r's tree of active row i (`[]`: no match).
    `added[r][i]`: that tree's nodes on the chain, as root-to-node token paths: the nodes the branch added.
    `sizes[r][i]`: that tree's distinct nodes (a tree padded to its round's size repeats its last node).
    `accepted[r][i]`: the accepted nodes of that row in that round, root and bonus token excluded, as token paths
    (tokens, not node indices, so that a verifier that verifies only part of the tree is read the same).
    """

    def __init__(self, monkeypatch):
        self.chains, self.added, self.sizes, self.accepted = [], [], [], []
        draft, accept, chain_trie = decode.draft, decode.accept, steps.chain_trie
        offered = []

        def recording_chain_trie(chain):
            offered.append(tuple(chain))
            return chain_trie(chain)

        def recording_draft(*args, **kwargs):
            offered.clear()
            trees = draft(*args, **kwargs)
            assert len(offered) == trees.tokens.shape[0], "expected one lookup chain per row"
            self.chains.append(list(offered))
            self.sizes.append([len(set(token_paths(trees.tokens, trees.parents, i)[1:])) for i in range(len(offered))])
            self.added.append(
                [
                    {path for path in token_paths(trees.tokens, trees.parents, i)[1:] if path == chain[: len(path)]}
                    for i, chain in enumerate(offered)
                ]
            )
            return trees

        def recording_accept(logits, trees, rows, choose=None, stops=None):
            acc = accept(logits, trees, rows, choose, stops)
            self.accepted.append(
                [
                    [token_paths(trees.tokens, trees.parents, i)[node] for node in path[1:]]
                    for i, path in enumerate(acc.paths())
                ]
            )
            return acc

        monkeypatch.setattr(steps, "chain_trie", recording_chain_trie)
        monkeypatch.setattr(decode, "draft", recording_draft)
        monkeypatch.setattr(decode, "accept", recording_accept)

    def added_nodes(self) -> int:
        return sum(len(added) for round_ in self.added for added in round_)

    def accepted_nodes(self) -> int:
        return sum(len(path) for round_ in self.accepted for path in round_)

    def accepted_outside_the_branch(self) -> list:
        """Accepted nodes the lookup branch did not add, as `(round, row, path)`."""
        return [
            (r, i, node)
            for r, (added, accepted) in enumerate(zip(self.added, self.accepted))
            for i, (row_added, path) in enumerate(zip(added, accepted))
            for node in path
            if node not in row_added
        ]


@pytest.mark.parametrize("arch,shape,batch", CASES, ids=[f"{a}-d{s[0]}w{s[1]}b{s[2]}-bs{b}" for a, s, b in CASES])
def test_random_head_matches_greedy(arch, shape, batch):  # (a)
    target = tiny_target(arch)
    head = tiny_head(target)
    ids, mask = prompts(batch)
    depth, width, budget = shape
    plain = greedy(target, ids, mask, max_new_tokens=24)
    forwards = TargetForwards(target)
    tree = greedy(
        target,
        ids,
        mask,
        max_new_tokens=24,
        assistant_model=head,
        tree_depth=depth,
        tree_width=width,
        tree_budget=budget,
    )
    forwards.remove()
    assert torch.equal(tree, plain)
    stats = head.last_stats
    assert stats.new_tokens == 24 * batch
    # the statistics report the forwards the target ran: the prefill over every row, then one verify per round
    assert stats.target_forwards == len(forwards.rows) == stats.rounds + 1 and forwards.rows[0] == batch
    # tau is the tokens the rounds committed (all but each row's first, which the prefill commits) per row a verify
    # forward read; rows that reached 24 tokens early leave the batch, so the verified rows are counted per forward
    assert stats.tau == forwards.tokens_per_verified_row(23 * batch)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("batch", [1, 3])
def test_never_right_drafter_commits_only_bonus_tokens(arch, batch):  # (b)
    target = tiny_target(arch)
    ids, mask = prompts(batch)
    plain = greedy(target, ids, mask, max_new_tokens=16)
    head = oracle_head(target, plain, mask, mode="never")
    forwards = TargetForwards(target)
    tree = greedy(target, ids, mask, max_new_tokens=16, assistant_model=head)
    forwards.remove()
    assert torch.equal(tree, plain)
    # the prefill, then one verify per token: each round commits only the bonus, in every row
    assert len(forwards.rows) == head.last_stats.target_forwards == 16
    assert forwards.tokens_per_verified_row(15 * batch) == head.last_stats.tau == 1.0


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("batch", [1, 3])
def test_always_right_drafter_commits_whole_paths(arch, batch):  # (c)
    target = tiny_target(arch)
    ids, mask = prompts(batch)
    plain = greedy(target, ids, mask, max_new_tokens=31)
    head = oracle_head(target, plain, mask, mode="always", tree_depth=5)
    forwards = TargetForwards(target)
    tree = greedy(target, ids, mask, max_new_tokens=31, assistant_model=head)
    forwards.remove()
    assert torch.equal(tree, plain)
    # 1 token from the prefill, then 5 rounds of depth 5 + bonus = 30 tokens
    assert len(forwards.rows) == head.last_stats.target_forwards == 6
    assert forwards.tokens_per_verified_row(30 * batch) == head.last_stats.tau == 6.0
    assert head.last_stats.acceptance_per_depth == [1.0] * 5


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("batch", [1, 3])
def test_sometimes_right_drafter_accepts_non_contiguous_nodes(arch, batch, monkeypatch):  # (d)
    target = tiny_target(arch)
    ids, mask = prompts(batch)
    plain = greedy(target, ids, mask, max_new_tokens=30)
    head = oracle_head(target, plain, mask, mode="sometimes", tree_depth=4, tree_width=3, tree_budget=30)
    paths = []
    accept = decode.accept

    def recording_accept(*args, **kwargs):
        acc = accept(*args, **kwargs)
        paths.extend(acc.paths())
        return acc

    monkeypatch.setattr(decode, "accept", recording_accept)
    tree = greedy(target, ids, mask, max_new_tokens=30, assistant_model=head)
    assert torch.equal(tree, plain)
    # paths through later siblings were accepted: some accepted path is not the first nodes 1, 2, ... of its tree
    assert any(path != list(range(len(path))) for path in paths if len(path) > 1)
    assert max(len(path) for path in paths) >= 3  # and some reached depth 2 or more
    assert head.last_stats.tau > 1.5


@pytest.mark.parametrize("batch", [1, 3])
def test_max_new_tokens_cuts_inside_an_accepted_path(batch):
    target = tiny_target("qwen3")
    ids, mask = prompts(batch)
    plain_long = greedy(target, ids, mask, max_new_tokens=40)
    head = oracle_head(target, plain_long, mask, tree_depth=7)
    for max_new in (1, 2, 10, 13):  # 1 from the prefill, then rounds of 8: 10 and 13 end mid-path
        plain = greedy(target, ids, mask, max_new_tokens=max_new)
        tree = greedy(target, ids, mask, max_new_tokens=max_new, assistant_model=head)
        assert torch.equal(tree, plain), max_new
        assert head.last_stats.new_tokens == max_new * batch


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_eos_inside_an_accepted_path(arch):
    target = tiny_target(arch)
    ids, mask = prompts(3)
    free = greedy(target, ids, mask, max_new_tokens=30)
    eos = int(free[1, ids.shape[1] + 7])  # a token row 1 emits mid-answer; rows stop at different times
    plain = greedy(target, ids, mask, max_new_tokens=30, eos_token_id=eos)
    head = oracle_head(target, free, mask, tree_depth=6, tree_budget=20)
    tree = greedy(target, ids, mask, max_new_tokens=30, eos_token_id=eos, assistant_model=head)
    assert torch.equal(tree, plain)
    assert (plain[:, ids.shape[1] :] == eos).any(), "the test needs at least one row that stops on EOS"
    assert head.last_stats.tau > 2.0


@pytest.mark.parametrize("block_attention", ["causal", "bidirectional"])
@pytest.mark.parametrize("scoring", ["logprob", "entropy", "mixed", "gap"])
def test_ablations_stay_lossless(block_attention, scoring):
    target = tiny_target("llama")
    head = tiny_head(target, block_attention=block_attention, tree_scoring=scoring)
    ids, mask = prompts(3)
    plain = greedy(target, ids, mask, max_new_tokens=20)
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=20, assistant_model=head), plain)


@pytest.mark.parametrize("batch", [1, 3])
def test_path_conditioned_drafting_stays_lossless(batch):
    target = tiny_target("qwen3")
    ids, mask = prompts(batch)
    plain = greedy(target, ids, mask, max_new_tokens=20)
    head = tiny_head(target, path_conditioning=True)
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=20, assistant_model=head), plain)
    oracle = oracle_head(target, plain, mask, path_conditioning=True, tree_depth=4)
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=20, assistant_model=oracle), plain)
    assert oracle.last_stats.tau > 3.0


def test_logits_processors_see_each_nodes_own_path():
    # repetition penalty and no-repeat-ngram depend on the tokens before each node, not on the tree
    target = tiny_target("llama")
    ids, mask = prompts(3)
    kwargs = dict(max_new_tokens=24, repetition_penalty=1.5, no_repeat_ngram_size=2)
    plain = greedy(target, ids, mask, **kwargs)
    head = oracle_head(target, greedy(target, ids, mask, **kwargs), mask)
    assert torch.equal(greedy(target, ids, mask, assistant_model=head, **kwargs), plain)
    assert head.last_stats.tau > 2.0


def test_return_dict_and_scores():
    target = tiny_target("llama")
    ids, mask = prompts(1)
    head = tiny_head(target)
    kwargs = dict(max_new_tokens=8, return_dict_in_generate=True, output_scores=True, output_logits=True)
    plain = greedy(target, ids, mask, **kwargs)
    tree = greedy(target, ids, mask, assistant_model=head, **kwargs)
    assert torch.equal(tree.sequences, plain.sequences)
    assert len(tree.scores) == len(plain.scores) == 8
    for ours, theirs in zip(tree.logits, plain.logits):
        # the same logits from a multi-token forward: fp32 reductions in another order, ~1e-6 apart
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_streamer_receives_prompt_then_tokens():
    target = tiny_target("llama")
    ids, mask = prompts(1)
    head = tiny_head(target)

    class Collect:
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    streamer = Collect()
    tree = greedy(target, ids, mask, max_new_tokens=12, assistant_model=head, streamer=streamer)
    assert streamer.ended
    assert streamer.chunks[0] == ids[0].tolist()
    assert sum(streamer.chunks[1:], []) == tree[0, ids.shape[1] :].tolist()


def use_flex(monkeypatch, compiled: bool) -> list:
    """Record the BlockMasks the verify builds; with `compiled=False`, flex_attention runs as the op itself rather
    than through transformers' `torch.compile` of it: on this CPU build (torch 2.13) inductor's C++ flex template
    fails to compile transformers' padding mask (plain `generate` over a left-padded batch fails with "error:
    'cur_kvSplitSize0' was not declared in this scope"), so padded batches run uncompiled. The plain reference and
    the tree loop always run the same way, so they compare the same attention."""
    if not compiled:
        from torch.nn.attention.flex_attention import flex_attention

        import transformers.integrations.flex_attention as transformers_flex

        def uncompiled(query, key, value, training=False, **kwargs):
            return flex_attention(query, key, value, **kwargs)

        monkeypatch.setattr(transformers_flex, "compile_friendly_flex_attention", uncompiled)
    block_masks = []
    build = tree_module.verification_block_mask

    def recording(*args, **kwargs):
        block_masks.append(build(*args, **kwargs))
        return block_masks[-1]

    monkeypatch.setattr(tree_module, "verification_block_mask", recording)  # where verify_attention_mask finds it
    return block_masks


def assert_same_up_to_float32_ties(reference, ids, mask, output):
    """`output` (another attention implementation's plain greedy) is `reference`'s plain greedy, or leaves it first
    where its two best float32 logits lie within `FLOAT32_TIE_TOLERANCE` (compiled flex_attention rounds apart from
    sdpa on some CPUs: seen on an AVX2-only host at a gap of that size, one token before the end)."""
    from jetspec.equality import FLOAT32_TIE_TOLERANCE, row_verdicts

    expected = greedy(reference, ids, mask, max_new_tokens=output.shape[1] - ids.shape[1])
    for verdict in row_verdicts(reference, ids, mask, expected, output, FLOAT32_TIE_TOLERANCE):
        assert verdict.kind != "mismatch", verdict


def check_compiled_flex_is_deterministic(target, head, ids, mask, plain):
    """Equality with plain greedy means something only for a target that computes the same thing twice. On an
    AVX2-only AMD host (torch 2.13) inductor's CPU flex template is not deterministic: the same plain `generate` call,
    or the same tree call, gave different tokens in one process, and plain greedy left the same model under sdpa
    where no tie explains it (logit gaps of 0.03-0.06). There the compiled
    case is an expected failure, with the evidence in its reason; where both repeat, the test goes on and holds the
    tree to plain greedy's tokens."""
    again = greedy(target, ids, mask, max_new_tokens=16)
    trees = [greedy(target, ids, mask, max_new_tokens=16, assistant_model=head) for _ in range(2)]
    try:
        assert_same_up_to_float32_ties(tiny_target("llama"), ids, mask, plain)
        agrees = True
    except AssertionError:
        agrees = False
    if not (torch.equal(again, plain) and torch.equal(*trees) and agrees):
        pytest.xfail(
            "compiled flex_attention is not deterministic on this CPU: plain greedy repeated "
            f"{torch.equal(again, plain)}, the tree call repeated {torch.equal(*trees)}, plain greedy agreed with "
            f"the same model under sdpa {agrees}"
        )


@pytest.mark.parametrize("batch,compiled", [(1, True), (1, False), (2, False)])
def test_flex_attention_target_is_verified_with_a_block_mask(batch, compiled, monkeypatch):
    from torch.nn.attention.flex_attention import BlockMask

    block_masks = use_flex(monkeypatch, compiled)
    target = tiny_target("llama", attn_implementation="flex_attention")
    ids, mask = prompts(batch)
    plain = greedy(target, ids, mask, max_new_tokens=16)
    head = tiny_head(target, tree_depth=4, tree_budget=12)  # budget > depth: siblings share positions
    if compiled:
        check_compiled_flex_is_deterministic(target, head, ids, mask, plain)
    assert_same_up_to_float32_ties(tiny_target("llama"), ids, mask, plain)  # the same model under sdpa
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=16, assistant_model=head), plain)
    oracle = oracle_head(target, plain, mask, mode="sometimes", tree_depth=4, tree_width=3, tree_budget=12)
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=16, assistant_model=oracle), plain)
    assert oracle.last_stats.tau > 1.5  # accepted paths through later siblings
    assert block_masks and all(isinstance(m, BlockMask) for m in block_masks)
    assert block_masks[0].shape[0] == batch and {m.shape[1:3] for m in block_masks} == {(1, 13)}  # root + 12 nodes
    assert target.config._attn_implementation == "flex_attention"


def test_flex_attention_sliding_window_per_layer_type(monkeypatch):
    block_masks = use_flex(monkeypatch, compiled=False)
    window = dict(sliding_window=6, use_sliding_window=True, layer_types=["sliding_attention", "full_attention"])
    target = tiny_target("qwen3", attn_implementation="flex_attention", **window)
    ids, mask = prompts(2)
    plain = greedy(target, ids, mask, max_new_tokens=24)
    assert torch.equal(plain, greedy(tiny_target("qwen3", **window), ids, mask, max_new_tokens=24))
    oracle = oracle_head(target, plain, mask, mode="sometimes")
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=24, assistant_model=oracle), plain)
    assert len(block_masks) == 2 * oracle.last_stats.rounds  # one per layer type and round


def test_plain_generate_is_untouched_by_the_hook(monkeypatch):
    target = tiny_target("llama")
    ids, mask = prompts(1)
    # with the hook installed, assisted decoding with an ordinary assistant runs through transformers: the assistant
    # drafts (its forward runs), the tree loop is never entered, and the output is transformers' own
    assistant = tiny_target("llama", seed=3)
    drafted = []
    assistant.register_forward_hook(lambda *args: drafted.append(1))
    entered = []
    monkeypatch.setattr(integration, "_decode", lambda *args, **kwargs: entered.append(1))
    plain = greedy(target, ids, mask, max_new_tokens=10)
    assisted = greedy(target, ids, mask, max_new_tokens=10, assistant_model=assistant, return_dict_in_generate=True)
    assert torch.equal(assisted.sequences, plain)
    assert drafted and not entered and not isinstance(assisted, JetSpecGenerateOutput)


def test_peft_adapted_target():
    from peft import LoraConfig, get_peft_model

    base = tiny_target("llama")
    torch.manual_seed(5)
    adapted = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    adapted.eval()
    ids, mask = prompts(3)
    plain = adapted.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    head = tiny_head(base)
    tree = adapted.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16, assistant_model=head
    )
    assert torch.equal(tree, plain)
    # the adapter changes the output, so the test compares against the adapted model, not the base
    with adapted.disable_adapter():
        assert not torch.equal(plain, greedy(adapted, ids, mask, max_new_tokens=16))


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


@pytest.mark.parametrize("batch", [1, 3])
def test_llama3_rope_scaling_target(batch):
    target = tiny_target("llama", rope_parameters=dict(LLAMA3_ROPE))
    ids, mask = prompts(batch)
    plain = greedy(target, ids, mask, max_new_tokens=24)
    assert not torch.equal(plain, greedy(tiny_target("llama"), ids, mask, max_new_tokens=24))  # scaling matters
    head = tiny_head(target)
    # the head rotates with the target's scaled frequencies, as transformers' own LlamaRotaryEmbedding computes them
    # for the target (positions past original_max_position_embeddings, where llama3 scaling changes the low
    # frequencies), not with plain rotary
    positions = torch.arange(40)[None]
    target_cos, target_sin = target.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    head_cos, head_sin = head.rotary(positions, torch.float32)
    plain_cos, _ = tiny_target("llama").model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    assert not torch.allclose(target_cos, plain_cos, atol=1e-3), "the test needs scaling that moves the tables"
    # the same fp32 products in the same order: equal up to rounding
    torch.testing.assert_close(head_cos[:, 0], target_cos)
    torch.testing.assert_close(head_sin[:, 0], target_sin)
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=24, assistant_model=head), plain)
    oracle = oracle_head(target, plain, mask, mode="sometimes")
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=24, assistant_model=oracle), plain)
    assert oracle.last_stats.tau > 1.5


def test_default_rope_head_rotates_as_its_target():
    # plain rotary at a rope_theta other than the default: the head's tables are those transformers' own
    # Qwen3RotaryEmbedding computes for the target it was built from
    target = tiny_target("qwen3", rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    head = tiny_head(target)
    positions = torch.arange(50)[None]
    target_cos, target_sin = target.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = head.rotary(positions, torch.float32)
    # the same fp32 products in the same order: equal up to rounding
    torch.testing.assert_close(cos[:, 0], target_cos)
    torch.testing.assert_close(sin[:, 0], target_sin)


@pytest.mark.parametrize("rope", [None, LLAMA3_ROPE], ids=["default", "llama3"])
@torch.no_grad()
def test_head_drafts_depend_only_on_relative_positions(rope):
    """Rotary encodes where a key is relative to its query: the same prompt features and block with every position
    (context and block alike) moved by the same offset give the same drafts. Rotating the context keys at positions
    other than the block's, or leaving either unrotated, breaks it."""
    target = tiny_target("llama", **({"rope_parameters": dict(rope)} if rope else {}))
    head = tiny_head(target, block_size=6)
    ids, _ = prompts(1)
    out = target(ids, output_hidden_states=True)
    features, s, b = head.target_features(out.hidden_states), ids.shape[1], head.config.block_size
    block = torch.tensor([[int(out.logits[0, -1].argmax())] + [head.config.mask_id] * (b - 1)])

    def drafts(offset):
        context = head.extend_context(None, features, torch.arange(s)[None] + offset, torch.ones(1, s, dtype=bool))
        return head.draft(block, torch.arange(s, s + b)[None] + offset, context).logits

    # fp32 rotations at other angles round differently: the logits (of size ~0.5) stay ~1e-7 apart; keys left
    # unrotated, or rotated at other positions than the block's, move them by ~0.1
    torch.testing.assert_close(drafts(37), drafts(0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seed", range(12))
def test_fuzz_random_settings_match_greedy(seed):
    """Random architecture (a binding sliding window sometimes), batch, prompts, tree shape, drafter, stopping and
    processors: always plain greedy."""
    g = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    arch = pick(ARCHITECTURES)
    target = tiny_target(arch, seed=seed, **({"sliding_window": pick([5, 256])} if arch == "mistral" else {}))
    batch = pick([1, 2, 3])
    ids, mask = prompts(batch, lengths=tuple(int(n) for n in torch.randint(1, 15, (3,), generator=g)), seed=seed)
    depth = pick([1, 2, 4, 7])
    shape = dict(
        tree_depth=depth,
        tree_width=pick([1, 2, 3, 5]),
        tree_budget=pick([1, 3, 8, 20, 40]),
        tree_lookup=pick([0, 0, depth, 1, 12]),
    )  # 12: a chain past the head's depths
    kwargs = dict(max_new_tokens=pick([1, 5, 17, 30]))
    if pick([False, True]):
        kwargs.update(repetition_penalty=1.3)
    free = greedy(target, ids, mask, **kwargs)
    if pick([False, True]) and free.shape[1] > ids.shape[1] + 2:
        kwargs.update(eos_token_id=int(free[0, ids.shape[1] + 2]))
    plain = greedy(target, ids, mask, **kwargs)
    mode = pick(["random", "sometimes", "always", "never"])
    if shape["tree_lookup"] and pick([False, True]):  # the chain scored by a prior, competing with the head's nodes
        shape["tree_lookup_prior"] = [[0.3, 0.1], [0.6, 0.4, 0.2], [0.95, 0.9]]
    if mode == "random":
        conditioning = pick([False, True]) and not shape["tree_lookup"]  # the two are exclusive
        head = tiny_head(target, seed=seed, block_size=8, path_conditioning=conditioning, **shape)
    else:
        head = oracle_head(target, free, mask, mode=mode, **shape)
    assert torch.equal(greedy(target, ids, mask, assistant_model=head, **kwargs), plain), (mode, shape, kwargs)


@pytest.mark.parametrize("arch", ["mistral", "qwen3"])
@pytest.mark.parametrize("batch", [1, 3])
def test_binding_sliding_window(arch, batch):
    # a window of 6 positions, far shorter than prompt + answer: every round's verify mask must drop the keys that
    # left the window, per layer type (qwen3: sliding and full layers alternate; mistral: every layer slides)
    window = dict(sliding_window=6)
    if arch == "qwen3":
        window.update(use_sliding_window=True, layer_types=["sliding_attention", "full_attention"])
    target = tiny_target(arch, **window)
    ids, mask = prompts(batch)
    plain = greedy(target, ids, mask, max_new_tokens=30)
    unbounded = tiny_target(
        arch,
        **{k: v for k, v in window.items() if k != "sliding_window"},
        **({"sliding_window": 4096} if arch == "mistral" else {}),
    )
    assert not torch.equal(plain, greedy(unbounded, ids, mask, max_new_tokens=30))  # the window binds
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=30, assistant_model=tiny_head(target)), plain)
    oracle = oracle_head(target, plain, mask, mode="sometimes")
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=30, assistant_model=oracle), plain)
    assert oracle.last_stats.tau > 1.5


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("batch", [1, 3])
def test_lookup_branch_is_lossless_and_accepts_repeats(arch, batch, monkeypatch):
    """A prompt that repeats itself: the prompt-lookup branch drafts the repeats, a random head alone cannot.
    Output is plain greedy either way, at any budget; with a never-right head every token a round commits besides
    its bonus is one the lookup branch drafted."""
    target = tiny_target(arch)
    ids, mask = prompts(batch)
    ids = torch.cat([ids, ids[:, -6:], ids[:, -6:]], dim=1)  # the last 6 tokens twice more
    mask = torch.cat([mask, mask[:, -6:], mask[:, -6:]], dim=1)
    plain = greedy(target, ids, mask, max_new_tokens=24)
    for budget, prior in ((1, None), (8, None), (8, [[0.2], [0.5], [0.9]])):
        head = tiny_head(target, tree_depth=4, tree_budget=budget, tree_lookup=4, tree_lookup_prior=prior)
        assert torch.equal(greedy(target, ids, mask, max_new_tokens=24, assistant_model=head), plain), budget
    alone = tiny_head(target, tree_depth=4, tree_budget=8)
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=24, assistant_model=alone), plain)
    assert head.last_stats.target_forwards < alone.last_stats.target_forwards  # measured 12-16 vs 22-24 at batch 1
    for prior in (None, [[0.2], [0.5], [0.9]]):  # the chain first, or scored against the head's nodes
        never = oracle_head(
            target, plain, mask, mode="never", tree_depth=4, tree_budget=8, tree_lookup=4, tree_lookup_prior=prior
        )
        with monkeypatch.context() as patch:
            branch = LookupBranch(patch)
            assert torch.equal(greedy(target, ids, mask, max_new_tokens=24, assistant_model=never), plain), prior
        # the head never drafts the target's token, so every accepted node is one the lookup branch added
        assert branch.accepted_outside_the_branch() == [], prior
        assert branch.added_nodes() > 0 and branch.accepted_nodes() > 0, prior
        if prior is None:  # the chain goes first, whole: every tree holds all of its row's chain (4 < budget 8)
            assert all(
                len(added) == len(chain)
                for round_, chains in zip(branch.added, branch.chains)
                for added, chain in zip(round_, chains)
            )
        assert never.last_stats.tau > 1.0  # a never-right head alone commits exactly 1 token per round, see (b)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_lookup_chain_past_the_head_s_depth_is_lossless_and_accepted(arch, batch):
    """A head of depth 2 with a 12-token lookup chain: on a prompt that repeats, rounds accept past depth 2."""
    target = tiny_target(arch)
    ids, mask = prompts(batch)
    ids = torch.cat([ids] + [ids[:, -8:]] * 4, dim=1)  # the last 8 tokens four more times
    mask = torch.cat([mask] + [mask[:, -8:]] * 4, dim=1)
    plain = greedy(target, ids, mask, max_new_tokens=40)
    for prior in (None, [[0.2], [0.5], [0.95]]):
        head = tiny_head(target, tree_depth=2, tree_budget=16, tree_lookup=12, tree_lookup_prior=prior)
        assert torch.equal(greedy(target, ids, mask, max_new_tokens=40, assistant_model=head), plain), prior
        stats = head.last_stats
        assert len(stats.acceptance_per_depth) == 12
        assert stats.acceptance_per_depth[2] > 0  # some round accepted a third drafted token: the chain's alone


def test_rows_whose_lookup_chains_differ_in_length_share_a_round(monkeypatch):
    """Width 1, depth 1: the head gives every tree one node, the lookup chain 0-6 more depending on the row, so one
    round's trees differ in size; the shorter ones are padded with copies of their last node."""
    target = tiny_target("llama")
    ids, mask = prompts(3)
    ids[0, -4:] = ids[0, -8:-4]  # row 0 repeats itself: long chains; rows 1 and 2 are random
    plain = greedy(target, ids, mask, max_new_tokens=30)
    head = tiny_head(target, tree_depth=1, tree_width=1, tree_budget=8, tree_lookup=6)
    branch = LookupBranch(monkeypatch)
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=30, assistant_model=head), plain)
    # the case the test is for: a round whose rows' trees differ in size
    assert any(len(set(sizes)) > 1 for sizes in branch.sizes)


@pytest.mark.parametrize("batch", [1, 3])
def test_multi_head_latent_attention_target(batch):
    """DeepSeek-V3 / Kimi K2 attention: a cache layer's keys and values have different last sizes, so compaction
    moves each by its own shape."""
    target = tiny_target("deepseek_v3")
    ids, mask = prompts(batch)
    with torch.no_grad():
        cache = DynamicCache()
        target(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    assert cache.layers[0].keys.shape[-1] != cache.layers[0].values.shape[-1], "the test needs MLA's shapes"
    plain = greedy(target, ids, mask, max_new_tokens=24)
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=24, assistant_model=tiny_head(target)), plain)
    oracle = oracle_head(target, plain, mask, mode="sometimes", tree_budget=20)
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=24, assistant_model=oracle), plain)
    assert oracle.last_stats.tau > 1.5


def test_a_processor_that_reads_the_batch_index_sees_plain_decoding_s_layout():
    """`prefix_allowed_tokens_fn` is told the batch row; each row here may use only tokens of its own residue, so a
    node processed at another row's index would pick other tokens."""
    target = tiny_target("llama")
    ids, mask = prompts(3)

    def allowed(batch_id, sent):
        return [t for t in range(128) if t % 3 == batch_id]

    kwargs = dict(max_new_tokens=20, prefix_allowed_tokens_fn=allowed)
    plain = greedy(target, ids, mask, **kwargs)
    assert all(int(t) % 3 == row for row in range(3) for t in plain[row, ids.shape[1] :])
    head = oracle_head(target, plain, mask, mode="sometimes")
    assert torch.equal(greedy(target, ids, mask, assistant_model=head, **kwargs), plain)
    assert head.last_stats.tau > 1.5


@pytest.mark.parametrize("head_dtype,target_dtype", [(torch.float64, torch.float32), (torch.float32, torch.float64)])
@pytest.mark.parametrize("arch,static", [("llama", None), ("llama", "eager"), ("mistral", None)])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_head_in_another_float_dtype_than_its_target(head_dtype, target_dtype, arch, static, batch):
    """A float64 head next to a float32 target, and a float32 head next to a float64 target: every mask of the call
    (the head's draft masks in its dtype, the verify's in the target's, kept across rounds) is built in its own
    dtype, so the call decodes plain greedy's tokens (it crashed where a float64 minimum met a float32 `where`).
    Mistral's sliding window at 6 makes the kept window masks rewrite their band every round; the "sometimes" oracle
    accepts non-contiguous paths, so compaction of the mixed dtypes is exercised too."""
    overrides = {"sliding_window": 6} if arch == "mistral" else {}
    target = tiny_target(arch, **overrides).to(target_dtype)
    ids, mask = prompts(batch)
    plain = greedy(target, ids, mask, max_new_tokens=24)
    kwargs = {"jetspec_static": static} if static else {}
    head = tiny_head(target, tree_lookup=4, tree_lookup_branches="trie").to(head_dtype)
    assert head.dtype == head_dtype and target.dtype == target_dtype
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=24, assistant_model=head, **kwargs), plain)
    oracle = oracle_head(target, plain, mask, mode="sometimes").to(head_dtype)
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=24, assistant_model=oracle, **kwargs), plain)
    assert oracle.last_stats.tau > 1.5
