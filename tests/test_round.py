"""The round's state between rounds, and what `return_dict_in_generate` returns.

Invariant checked here: after any round, for every row still decoding, the target cache's valid entries are the
keys/values a fresh prefill of the committed sequence (minus its last token, the next anchor) computes, and the
head's valid context keys/values are what a fresh `extend_context` over that prefill's features computes. A
compaction that kept the wrong tree nodes, or kept them in the wrong order, breaks both.
"""

import pytest
import torch
from transformers.cache_utils import DynamicCache

import modeling_jetspec.decode as decode
import modeling_jetspec.steps as steps
import modeling_jetspec.verifiers as verifiers
from modeling_jetspec import compat
from modeling_jetspec import JetSpecGenerateOutput
from jetspec.tiny import oracle_head, prompts, tiny_head, tiny_target


def greedy(target, ids, mask, **kwargs):
    return target.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kwargs)


@pytest.mark.parametrize("settings", [{}, dict(repetition_penalty=1.2)], ids=["vectorized", "walk"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_caches_after_several_rounds_equal_a_fresh_prefill(arch, settings, monkeypatch):
    target = tiny_target(arch)
    ids, mask = prompts(3)
    plain = greedy(target, ids, mask, max_new_tokens=30, **settings)
    # (d) sometimes right: accepted nodes are non-contiguous, so compaction has to pick them out of the tree
    head = oracle_head(target, plain, mask, mode="sometimes", tree_depth=4, tree_width=3, tree_budget=20)
    snapshots, calls = [], []
    commit, compact = decode.commit, verifiers.compact

    def recording_commit(call, *args, **kwargs):
        calls.append(call)
        return commit(call, *args, **kwargs)

    def recording_compact(*args, **kwargs):
        state = compact(*args, **kwargs)
        if state.rows.numel():
            call = calls[-1]
            snapshots.append(
                dict(
                    rows=state.rows.tolist(),
                    lengths=list(call.lengths),
                    sequences=call.sequences.clone(),
                    valid=state.valid.clone(),
                    context_valid=state.context.valid.clone(),
                    cache=[(layer.keys.clone(), layer.values.clone()) for layer in state.cache.layers],
                    context=[(k.clone(), v.clone()) for k, v in zip(state.context.keys, state.context.values)],
                    anchors=state.anchors.tolist(),
                    anchor_pos=state.anchor_pos.tolist(),
                )
            )
        return state

    monkeypatch.setattr(decode, "commit", recording_commit)
    monkeypatch.setattr(verifiers, "compact", recording_compact)
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=30, assistant_model=head, **settings), plain)
    assert len(snapshots) >= 4
    pads = (mask == 0).sum(-1).tolist()
    for snap in snapshots[1:4]:  # after rounds 2, 3 and 4
        for i, row in enumerate(snap["rows"]):
            tokens = snap["sequences"][row, pads[row] : snap["lengths"][row]]  # the row's committed tokens
            assert snap["anchors"][i] == int(tokens[-1]) and snap["anchor_pos"][i] == len(tokens) - 1
            with torch.no_grad():
                cache = DynamicCache()
                out = target(tokens[None, :-1], past_key_values=cache, use_cache=True, output_hidden_states=True)
                fresh = head.extend_context(
                    None,
                    head.target_features(out.hidden_states),
                    torch.arange(len(tokens) - 1)[None],
                    torch.ones(1, len(tokens) - 1, dtype=torch.bool),
                )
            # the same keys/values, computed once by a verify forward over a tree with masked entries and once by
            # a plain prefill: fp32 sums in another order, ~1e-6 apart after two layers
            for (keys, values), layer in zip(snap["cache"], cache.layers):
                torch.testing.assert_close(keys[i][:, snap["valid"][i]], layer.keys[0], rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(values[i][:, snap["valid"][i]], layer.values[0], rtol=1e-4, atol=1e-5)
            for (keys, values), k, v in zip(snap["context"], fresh.keys, fresh.values):
                torch.testing.assert_close(keys[i][:, snap["context_valid"][i]], k[0], rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(values[i][:, snap["context_valid"][i]], v[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "settings", [{}, dict(repetition_penalty=1.3, no_repeat_ngram_size=3)], ids=["no-processors", "processors"]
)
def test_scores_at_batch_3_with_a_row_finishing_early(settings):
    target = tiny_target("llama")
    ids, mask = prompts(3)
    free = greedy(target, ids, mask, max_new_tokens=20, **settings)
    eos = int(free[1, ids.shape[1] + 4])  # row 1 stops after 5 tokens, the others later or never
    kwargs = dict(
        max_new_tokens=20,
        eos_token_id=eos,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
        **settings,
    )
    plain = greedy(target, ids, mask, **kwargs)
    head = oracle_head(target, plain.sequences, mask, mode="sometimes", tree_depth=4, tree_budget=16)
    tree = greedy(target, ids, mask, assistant_model=head, **kwargs)
    assert torch.equal(tree.sequences, plain.sequences)
    assert isinstance(tree, JetSpecGenerateOutput) and tree.jetspec_stats is head.last_stats
    assert tree.jetspec_stats.tau > 1.2
    new = plain.sequences[:, ids.shape[1] :]
    ends = [int((r == eos).nonzero()[0]) + 1 if (r == eos).any() else new.shape[1] for r in new]
    assert min(ends) < new.shape[1], "the test needs a row that finishes early"
    assert len(tree.scores) == len(plain.scores) == len(tree.logits) == new.shape[1]
    for step in range(new.shape[1]):
        for row, end in enumerate(ends):
            if step < end:
                # the same logits from a multi-token forward: fp32 sums in another order, ~1e-6 apart
                torch.testing.assert_close(tree.scores[step][row], plain.scores[step][row], rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(tree.logits[step][row], plain.logits[step][row], rtol=1e-4, atol=1e-4)
            else:  # documented: a finished row holds zeros (plain generate keeps computing it on padding)
                assert not tree.scores[step][row].any() and not tree.logits[step][row].any()


def test_stats_come_with_the_output_and_on_the_head():
    target = tiny_target("qwen3")
    ids, mask = prompts(1)
    head = tiny_head(target)
    out = greedy(target, ids, mask, max_new_tokens=9, assistant_model=head, return_dict_in_generate=True)
    first = out.jetspec_stats
    assert first.new_tokens == 9 and first.target_forwards == first.rounds + 1
    again = greedy(target, ids, mask, max_new_tokens=5, assistant_model=head, return_dict_in_generate=True)
    assert again.jetspec_stats.new_tokens == 5 and first.new_tokens == 9  # each call's own statistics
    assert head.last_stats is again.jetspec_stats


def test_verify_costs_are_kept_per_target_object():
    target = tiny_target("qwen3")
    ids, mask = prompts(1)
    head = tiny_head(target, tree_budget="auto", tau_by_budget={"head": {"4": 1.5, "8": 2.0}})
    greedy(target, ids, mask, max_new_tokens=4, assistant_model=head)
    assert list(head.verify_cost_cache.keys()) == [target]
    del target
    import gc

    gc.collect()
    assert len(head.verify_cost_cache) == 0  # an entry goes with its target: a new one never inherits its costs


@pytest.mark.parametrize("kind", ["dynamic", "pooled"])
@pytest.mark.parametrize(
    "nodes, counts",
    [
        ([[0, 2, 3], [0, 1, 0]], [3, 2]),  # row 0 accepted root, 2, 3; row 1 root, 1, then a hole
        ([[0, 3, 1]], [3]),  # one row (moved by a plain index): a later node before an earlier one
        ([[0], [0]], [1, 1]),  # no row accepted a node: nothing moves, the tree's entries are cropped
    ],
    ids=["batch-with-hole", "one-row", "root-only"],
)
def test_compaction_moves_only_the_accepted_entries_behind_the_past(nodes, counts, kind):
    """After a verify forward a layer holds `past` entries, then one per tree node. Compaction leaves the past in place
    (the same storage, the same values), moves the accepted nodes' entries behind it in path order, and crops; keys
    and values are moved each by its own shape (their last sizes differ under multi-head latent attention). A hole
    (past a row's count) is masked, so its entry is not checked. "pooled": the tree loop's own cache, whose layers'
    keys (values) are slices of one buffer after the verify's growth, moved for all layers at once."""
    past, nodes_in_tree, layers = 5, 4, 3
    rows = len(nodes)
    g = torch.Generator().manual_seed(0)
    # per layer (A, H, S + n + 1, D_k) and (A, H, S + n + 1, D_v)
    keys = [torch.randn(rows, 3, past + nodes_in_tree, 6, generator=g) for _ in range(layers)]
    values = [torch.randn(rows, 3, past + nodes_in_tree, 2, generator=g) for _ in range(layers)]
    cache = DynamicCache() if kind == "dynamic" else compat.growing_cache()
    for i in range(layers):
        if kind == "dynamic":
            cache.update(keys[i].clone(), values[i].clone(), layer_idx=i)
        else:  # the prompt's entries, then the tree's (the verify: every layer grows into the pool)
            cache.update(keys[i][:, :, :past].clone(), values[i][:, :, :past].clone(), layer_idx=i)
    if kind == "pooled":
        for i in range(layers):
            cache.update(keys[i][:, :, past:].clone(), values[i][:, :, past:].clone(), layer_idx=i)
        assert compat.pooled_entries(cache) is not None
    storage = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
    steps.keep_accepted_entries(cache, past, torch.tensor(nodes))
    width = len(nodes[0])
    for i, layer in enumerate(cache.layers):
        assert (layer.keys.data_ptr(), layer.values.data_ptr()) == storage[i]  # nothing was copied to a new tensor
        assert layer.keys.shape == (rows, 3, past + width, 6) and layer.values.shape == (rows, 3, past + width, 2)
        assert torch.equal(layer.keys[:, :, :past], keys[i][:, :, :past])
        assert torch.equal(layer.values[:, :, :past], values[i][:, :, :past])
        for row in range(rows):
            for slot, node in enumerate(nodes[row][: counts[row]]):
                assert torch.equal(layer.keys[row, :, past + slot], keys[i][row, :, past + node])
                assert torch.equal(layer.values[row, :, past + slot], values[i][row, :, past + node])


def test_row_wise_processors_see_one_row_and_prefix_constraints_the_batch(monkeypatch):
    """At batch 3 a node's scores are processed on its row alone by transformers' row-wise processors (no copy of the
    row per batch row), and in the call's batch layout by `prefix_allowed_tokens_fn`'s processor, which is told the
    batch index; the output is plain decoding's."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper
    from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor

    seen = {"row_wise": set(), "prefix": set()}

    def spy(cls, key):
        original = cls.__call__

        def call(self, input_ids, scores):
            seen[key].add(tuple(scores.shape))
            return original(self, input_ids, scores)

        monkeypatch.setattr(cls, "__call__", call)  # the type stays transformers' own (processors match by type)

    spy(TemperatureLogitsWarper, "row_wise")
    spy(PrefixConstrainedLogitsProcessor, "prefix")
    target = tiny_target("llama")
    ids, mask = prompts(3)
    kwargs = dict(
        max_new_tokens=16,
        logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.9)]),
        prefix_allowed_tokens_fn=lambda batch_id, tokens: [t for t in range(128) if t % 3 != batch_id],
    )
    plain = greedy(target, ids, mask, **kwargs)
    seen = {"row_wise": set(), "prefix": set()}
    head = oracle_head(target, plain, mask, mode="sometimes")
    tree = greedy(target, ids, mask, assistant_model=head, **kwargs)
    assert torch.equal(tree, plain)
    vocab = target.config.vocab_size
    # the first token is processed for the whole batch at once (every row has the same length then), every node after
    # it on one row: by the row-wise processor as it is, by the prefix constraint repeated to the batch size
    assert seen["row_wise"] == {(3, vocab), (1, vocab)} and seen["prefix"] == {(3, vocab)}


@pytest.mark.parametrize("vocab", [7, 600, 49152, 50257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_acceptance_argmax_is_torch_argmax_with_ties_nans_and_a_ragged_last_chunk(vocab, dtype):
    from modeling_jetspec.acceptance import first_argmax

    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, 5, vocab, generator=g).to(dtype)
    cases = [logits, logits.round()]  # rounded: many equal maxima, the first must win
    peaks = torch.zeros(4, vocab, dtype=dtype)
    peaks[0, [vocab // 3, vocab - 1]] = 1  # a tie in two chunks
    peaks[1, [vocab - 1, vocab // 2]] = float("nan")  # NaN wins, the first one
    peaks[2, vocab - 1] = float("inf")  # in the ragged rest
    peaks[3] = float("-inf")  # all equal
    cases += [peaks, logits.transpose(0, 1)]  # and a non-contiguous view
    for case in cases:
        got, want = first_argmax(case), case.argmax(-1)
        assert got.shape == want.shape and torch.equal(got, want), (case.shape, got, want)


@pytest.mark.parametrize("seed", range(6))
def test_greedy_acceptance_on_the_host_is_the_vectorized_one(seed):
    """On a CPU greedy acceptance reads the target's choices once and walks the host trees
    (`acceptance._accept_greedy_on_host`); it must accept the nodes and commit the tokens of the vectorized version,
    on random trees whose tokens often are the target's choices, with duplicate siblings (the padding copies of a
    tree's last node, and equal tokens under one parent) and rows that accept nothing; and the EOS verdicts it reads
    with the choices are those commit would judge on the committed tokens."""
    from modeling_jetspec.acceptance import _accept_greedy, _accept_greedy_on_host
    from modeling_jetspec.state import DraftTrees
    from modeling_jetspec.tree import Tree, ancestor_mask_of

    g = torch.Generator().manual_seed(seed)
    rows, n, vocab = 4, 12, 6  # a small vocabulary: many nodes match the target's choice, some twice under a parent
    trees = []
    for _ in range(rows):
        parents = [int(torch.randint(0, node, (1,), generator=g)) for node in range(1, n + 1)]
        depths = []
        for parent in parents:
            depths.append(1 + (depths[parent - 1] if parent else 0))
        tokens = torch.randint(0, vocab, (n,), generator=g).tolist()
        tokens[-3:], parents[-3:], depths[-3:] = [tokens[-4]] * 3, [parents[-4]] * 3, [depths[-4]] * 3  # copies
        trees.append(Tree(tokens, parents, depths, [0.0] * n))
    logits = torch.randn(rows, n + 1, vocab, generator=g)
    drafted = DraftTrees(
        tokens=torch.tensor([t.tokens for t in trees]),
        parents=torch.tensor([t.parents for t in trees]),
        depths=torch.tensor([[0] + t.depths for t in trees]),
        ancestors=ancestor_mask_of([t.parents for t in trees]),
        budget=n,
        host=trees,
    )
    from transformers import EosTokenCriteria

    eos = EosTokenCriteria(eos_token_id=[1, 4])  # judged on every node's choice, read with the choices
    vectorized, walked = _accept_greedy(logits, drafted), _accept_greedy_on_host(logits, drafted, [eos])
    assert torch.equal(walked.count, vectorized.count)
    assert walked.count.max() > 1  # some row accepted nodes
    for i, count in enumerate(vectorized.count.tolist()):
        assert torch.equal(walked.nodes[i, :count], vectorized.nodes[i, :count])
        assert torch.equal(walked.tokens[i, :count], vectorized.tokens[i, :count])
        assert walked.host[i] == (vectorized.nodes[i, :count].tolist(), vectorized.tokens[i, :count].tolist())
        # the verdicts commit would judge on the committed tokens (`stopping.stop_marks`)
        assert walked.marks[i] == eos(vectorized.tokens[i, :count, None], None).tolist()
    assert any(any(marks) for marks in walked.marks) and not all(all(marks) for marks in walked.marks)
