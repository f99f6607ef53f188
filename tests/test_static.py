"""The static path (`modeling_jetspec/static.py`, opt-in: `jetspec_static=` or `cache_implementation="static"`)
returns plain greedy's tokens, token for token (fp32): a `StaticCache` compacted by index copies, trees padded to a
fixed node count, finished rows masked in the buffers instead of removed, the head's context in fixed buffers; and
once compiled with `torch.compile`.
"""

import pytest
import torch
from transformers import GenerationConfig

import modeling_jetspec.decode as decode
import modeling_jetspec.static as static
from test_hybrid import hybrid_target
from jetspec.tiny import oracle_head, prompts, tiny_head, tiny_target

SHAPES = [(1, 1, 1), (4, 3, 12), (3, 8, 40)]  # (depth, width, budget)


def greedy(target, ids, mask, **kwargs):
    return target.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kwargs)


def eos_case(target, batch: int, new: int):
    """Prompts, a plain greedy output whose rows stop on an EOS at different steps, and that EOS."""
    ids, mask = prompts(batch)
    free = greedy(target, ids, mask, max_new_tokens=new)
    eos = int(free[batch - 1, ids.shape[1] + new // 3])  # a token the last row emits a third of the way in
    plain = greedy(target, ids, mask, max_new_tokens=new, eos_token_id=eos)
    return ids, mask, free, plain, eos


def stop_steps(output: torch.Tensor, prompt_length: int, eos: int) -> list:
    """Per row, the step of its first EOS (None: none)."""
    steps = []
    for row in output[:, prompt_length:].tolist():
        steps.append(row.index(eos) if eos in row else None)
    return steps


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v3"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"d{s[0]}w{s[1]}b{s[2]}")
@pytest.mark.parametrize("batch", [1, 2])
def test_random_head_matches_greedy_with_rows_finishing_apart(arch, shape, batch, verifiers):
    target = tiny_target(arch)
    ids, mask, _, plain, eos = eos_case(target, batch, 24)
    depth, width, budget = shape
    head = tiny_head(target)
    tree = greedy(
        target,
        ids,
        mask,
        max_new_tokens=24,
        eos_token_id=eos,
        assistant_model=head,
        tree_depth=depth,
        tree_width=width,
        tree_budget=budget,
        jetspec_static="eager",
    )
    assert torch.equal(tree, plain)
    assert len(verifiers) == 1 and not verifiers[0].compiled
    assert verifiers[0].nodes == min(budget, sum(width**d for d in range(1, depth + 1)))
    if batch == 2:  # the rows stopped at different steps: one finished while the other went on
        first, second = stop_steps(plain, ids.shape[1], eos)
        assert first != second


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("budget", [6, 20])
def test_sometimes_right_drafter_accepts_paths_in_place(batch, budget, verifiers):
    # accepted paths run through second and third children, so the compaction moves non-contiguous nodes; rows stop
    # on an EOS at different rounds and stay in the buffers, masked
    target = tiny_target("qwen3")
    ids, mask, free, plain, eos = eos_case(target, batch, 30)
    head = oracle_head(target, free, mask, mode="sometimes", tree_depth=4, tree_width=3, tree_budget=budget)
    tree = greedy(target, ids, mask, max_new_tokens=30, eos_token_id=eos, assistant_model=head, jetspec_static="eager")
    assert torch.equal(tree, plain)
    assert head.last_stats.tau > 1.5
    verifier = verifiers[0]
    assert verifier.batch == batch and verifier.nodes == budget


def test_always_right_drafter_commits_whole_paths():
    target = tiny_target("llama")
    ids, mask = prompts(2)
    plain = greedy(target, ids, mask, max_new_tokens=31)
    head = oracle_head(target, plain, mask, mode="always", tree_depth=5)
    tree = greedy(target, ids, mask, max_new_tokens=31, assistant_model=head, jetspec_static="eager")
    assert torch.equal(tree, plain)
    assert head.last_stats.target_forwards == 6 and head.last_stats.tau == 6.0  # prefill, then 5 rounds of 6


def test_full_columns_are_repacked(monkeypatch, verifiers):
    # a cache of exactly max_length + one verify: a chain of width 1 that each row's oracle gets right at different
    # rounds leaves holes in the rows that accepted less, they fill it, and every row is squeezed (valid columns
    # first) before the next verify
    monkeypatch.setattr(static, "LENGTH_BUCKET", 1)
    target = tiny_target("llama")
    ids, mask = prompts(3)
    plain = greedy(target, ids, mask, max_new_tokens=40)
    head = oracle_head(target, plain, mask, mode="sometimes", tree_depth=4, tree_width=1, tree_budget=4)
    tree = greedy(target, ids, mask, max_new_tokens=40, assistant_model=head, jetspec_static="eager")
    assert torch.equal(tree, plain)
    verifier = verifiers[0]
    assert verifier.length == ids.shape[1] + 40 + 4 + 1
    assert verifier.repacks >= 1
    assert any(len(set(round_)) > 1 for round_ in head.last_stats.accepted)  # rows accepted unevenly in a round


@pytest.mark.parametrize("branches", ["chain", "trie"])
def test_lookup_branch_and_processors(branches):
    target = tiny_target("llama")
    ids, mask = prompts(2)
    kwargs = dict(max_new_tokens=24, repetition_penalty=1.3, no_repeat_ngram_size=3)
    plain = greedy(target, ids, mask, **kwargs)
    head = tiny_head(target, tree_lookup=5, tree_lookup_branches=branches)
    assert torch.equal(greedy(target, ids, mask, assistant_model=head, jetspec_static="eager", **kwargs), plain)
    tree = greedy(target, ids, mask, assistant_model=head, jetspec_static="eager", max_new_tokens=24)
    assert torch.equal(tree, greedy(target, ids, mask, max_new_tokens=24))


@pytest.mark.parametrize("branches", ["chain", "trie"])
def test_the_static_path_drafts_the_default_paths_trees(branches, monkeypatch):
    # the static draft is the default draft over other buffers (`steps.draft_trees`): round by round, the same trees
    # (batch 1, so that no tree is padded on either path), node scores equal up to the head's float32 rounding over
    # contexts laid out in other columns
    target = tiny_target("llama")
    ids, mask = prompts(1)
    head = tiny_head(target, tree_lookup=5, tree_lookup_branches=branches, tree_budget=10)
    drafted = {"default": [], "static": []}

    def spy(original, path):
        def recording(*args, **kwargs):
            trees = original(*args, **kwargs)
            drafted[path].append(trees.host[0])
            return trees

        return recording

    monkeypatch.setattr(decode, "draft", spy(decode.draft, "default"))
    monkeypatch.setattr(static.StaticVerifier, "draft", spy(static.StaticVerifier.draft, "static"))
    outputs = [
        greedy(target, ids, mask, max_new_tokens=24, assistant_model=head, jetspec_static=mode)
        for mode in (None, "eager")
    ]
    assert torch.equal(outputs[0], outputs[1])
    assert len(drafted["default"]) == len(drafted["static"]) > 1
    for ours, theirs in zip(drafted["static"], drafted["default"]):
        assert (ours.tokens, ours.parents, ours.depths) == (theirs.tokens, theirs.parents, theirs.depths)
        assert ours.scores == pytest.approx(theirs.scores, abs=1e-4)


def test_scores_and_logits_as_plain_generate():
    target = tiny_target("llama")
    ids, mask = prompts(2)
    kwargs = dict(max_new_tokens=12, return_dict_in_generate=True, output_scores=True, output_logits=True)
    plain = greedy(target, ids, mask, **kwargs)
    head = oracle_head(target, plain.sequences, mask, mode="sometimes")
    tree = greedy(target, ids, mask, assistant_model=head, jetspec_static="eager", **kwargs)
    assert torch.equal(tree.sequences, plain.sequences)
    for ours, theirs in zip(tree.logits, plain.logits):
        torch.testing.assert_close(ours, theirs)


def test_static_cache_implementation_takes_the_static_path(verifiers):
    # cache_implementation="static" alone: the static path, compiled where plain generate would compile (on the CPU:
    # not without a compile_config that compiles on every device), given directly or in a generation config
    target = tiny_target("llama")
    ids, mask = prompts(2)
    plain = greedy(target, ids, mask, max_new_tokens=10)
    head = tiny_head(target)
    direct = greedy(target, ids, mask, max_new_tokens=10, assistant_model=head, cache_implementation="static")
    config = GenerationConfig(max_new_tokens=10, do_sample=False, cache_implementation="static")
    inside = target.generate(input_ids=ids, attention_mask=mask, generation_config=config, assistant_model=head)
    assert torch.equal(direct, plain) and torch.equal(inside, plain)
    assert [v.mode for v in verifiers] == ["auto", "auto"]
    assert [v.compiled for v in verifiers] == [False, False]
    assert config.cache_implementation == "static"  # the caller's config is left as it was


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(jetspec_static="fast"), r"jetspec_static in \(None, False, True, 'eager', 'compile'\), got 'fast'"),
        (dict(jetspec_static=False, cache_implementation="static"), "jetspec_static unset .* got False"),
        (dict(jetspec_static="eager", path_conditioning=True), "path_conditioning=False on the static path"),
    ],
    ids=["value", "conflict", "path-conditioning"],
)
def test_what_the_static_path_cannot_run_is_refused(kwargs, message):
    target = tiny_target("llama")
    ids, mask = prompts(1)
    with pytest.raises(ValueError, match=message):
        greedy(target, ids, mask, max_new_tokens=4, assistant_model=tiny_head(target), **kwargs)


def test_sliding_and_hybrid_targets_are_refused():
    ids, mask = prompts(1)
    mistral = tiny_target("mistral")
    with pytest.raises(ValueError, match="without sliding-window layers on the static path"):
        greedy(mistral, ids, mask, max_new_tokens=4, assistant_model=tiny_head(mistral), jetspec_static="eager")
    hybrid = hybrid_target("qwen3_next")
    ids, mask = prompts(1, vocab_size=hybrid.config.vocab_size)
    with pytest.raises(ValueError, match="attention keys/values on the static path"):
        greedy(hybrid, ids, mask, max_new_tokens=4, assistant_model=tiny_head(hybrid), jetspec_static="eager")


def test_compiled_path_matches_greedy(verifiers):
    # torch.compile'd verify forward and draft (inductor on the CPU), two rows stopping apart, a lookup branch so that
    # some drafts are accepted; a second call of the same shapes reuses the compiled graphs
    target = tiny_target("llama")
    ids, mask, _, plain, eos = eos_case(target, 2, 12)
    head = tiny_head(target, tree_lookup=3, tree_budget=8)
    for _ in range(2):
        tree = greedy(
            target, ids, mask, max_new_tokens=12, eos_token_id=eos, assistant_model=head, jetspec_static="compile"
        )
        assert torch.equal(tree, plain)
    assert [v.compiled for v in verifiers] == [True, True]
    first, second = stop_steps(plain, ids.shape[1], eos)
    assert first != second
