"""`JetSpecStats.token_sources`: the round records who proposed each token it commits, as it commits it.

Sources: "head" (the head's draft), "lookup" (the model-free branch, chain or trie), "both", "target" (the prefill's
token and every round's bonus token). Settings, bracketing who can be right:
  (a) a head-only tree (`tree_lookup=0`): nothing but the head drafts, so only "head" and "target" appear;
  (b) a never-right head with the lookup branch, on a prompt that repeats: the head never offers the target's token,
      so every accepted draft token is "lookup", and there are some;
  (c) an always-right head with the lookup branch: the head's tokens are accepted, some of them also on the branch
      ("both");
in each, one source per new token of every row (batch 1 and 3, rows stopped at different lengths), and the last
source of every round is "target", on the default path, the static path, a hybrid target's chain verifier and a
sampled call (its acceptance walks the tree on the host).
"""

import pytest
import torch
from jetspec.tiny import oracle_head, prompts, tiny_target
from transformers import StoppingCriteria, StoppingCriteriaList

from modeling_jetspec.calibration import TOKEN_SOURCES, committed_sources


def repeating(batch: int, vocab_size: int = 128):
    """Prompts whose last 6 tokens come twice more: the lookup branch has something to draft."""
    ids, mask = prompts(batch, vocab_size=vocab_size)
    return torch.cat([ids, ids[:, -6:], ids[:, -6:]], dim=1), torch.cat([mask, mask[:, -6:], mask[:, -6:]], dim=1)


def generate(target, ids, mask, **kwargs):
    kwargs = {"max_new_tokens": 24, "do_sample": False, **kwargs}
    return target.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **kwargs)


def new_tokens(sequences: torch.Tensor, prompt_length: int, eos: int | None = None) -> list:
    """Per row, its new tokens in the output: up to and including its first `eos` (padding after it)."""
    rows = []
    for row in sequences[:, prompt_length:].tolist():
        rows.append(row[: row.index(eos) + 1] if eos is not None and eos in row else row)
    return rows


def check_rounds(stats, rows: list):
    """One source per new token of each row, each a known source, the first one the prefill's ("target")."""
    assert [len(sources) for sources in stats.token_sources] == [len(row) for row in rows]
    assert all(set(sources) <= set(TOKEN_SOURCES) for sources in stats.token_sources)
    assert all(sources[0] == "target" for sources in stats.token_sources)


def by_rounds(stats, rows: list, drafter: str) -> list:
    """What each row's sources must be when every accepted draft token is `drafter`'s and rows stop only at the
    length limit: the prefill's token, then per round its accepted drafts and its bonus ("target"), cut where the
    row's output ends. A round's `accepted` lists the rows still short of their length, in batch order."""
    expected = [["target"] for _ in rows]
    for accepted in stats.accepted:
        active = [i for i, row in enumerate(rows) if len(expected[i]) < len(row)]
        assert len(active) == len(accepted)
        for i, count in zip(active, accepted):
            expected[i] = (expected[i] + [drafter] * count + ["target"])[: len(rows[i])]
    return expected


def test_committed_sources_name_every_token_by_one_rule():
    # the head offered 4 or 5 at depth 1 and 6 at depth 2; the branch continues the anchor with 5 then 7
    head_tokens = [[4, 5], [6, 9]]
    trie = {(): {5: 1}, (5,): {7: 1}}
    assert committed_sources(head_tokens, trie, [5, 7, 3]) == ["both", "lookup", "target"]
    assert committed_sources(head_tokens, trie, [4, 6, 3]) == ["head", "head", "target"]
    assert committed_sources(head_tokens, None, [5, 9]) == ["head", "target"]  # no branch in the call
    assert committed_sources(head_tokens, None, [9, 9, 2]) == ["head", "head", "target"]  # a padded chain's repeat
    # a path that leaves the branch is the head's from there on, even where the branch holds the same token later
    assert committed_sources(head_tokens, {(): {4: 1}, (9,): {6: 1}}, [4, 6, 1]) == ["both", "head", "target"]
    assert committed_sources(None, None, [8]) == ["target"]  # a round that accepted nothing: its bonus alone


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("static", [None, "eager"])
def test_a_head_only_tree_gives_head_and_target_sources(batch, static):  # (a)
    target = tiny_target("llama")
    ids, mask = repeating(batch)
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    head = oracle_head(target, plain, mask, mode="sometimes", tree_budget=8, tree_lookup=0)
    out = generate(target, ids, mask, assistant_model=head, jetspec_static=static)
    assert torch.equal(out.sequences, plain)
    stats, rows = out.jetspec_stats, new_tokens(out.sequences, ids.shape[1])
    check_rounds(stats, rows)
    # every accepted draft token is the head's, every bonus token the target's
    assert stats.token_sources == by_rounds(stats, rows, "head")
    assert any("head" in sources for sources in stats.token_sources)  # the sometimes-right head's drafts were taken


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("static", [None, "eager"])
@pytest.mark.parametrize("branches", ["chain", "trie"])
def test_a_never_right_head_with_the_lookup_branch_gives_lookup(batch, static, branches):  # (b)
    target = tiny_target("llama")
    ids, mask = repeating(batch)
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    never = oracle_head(target, plain, mask, mode="never", tree_budget=8, tree_lookup=4, tree_lookup_branches=branches)
    out = generate(target, ids, mask, assistant_model=never, jetspec_static=static)
    assert torch.equal(out.sequences, plain)
    stats, rows = out.jetspec_stats, new_tokens(out.sequences, ids.shape[1])
    check_rounds(stats, rows)
    assert stats.token_sources == by_rounds(stats, rows, "lookup")
    assert any("lookup" in sources for sources in stats.token_sources)


def test_an_always_right_head_on_the_branch_counts_as_both():  # (c)
    target = tiny_target("llama")
    ids, mask = repeating(1)
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    always = oracle_head(target, plain, mask, mode="always", tree_budget=8, tree_lookup=4)
    out = generate(target, ids, mask, assistant_model=always)
    assert torch.equal(out.sequences, plain)
    sources = out.jetspec_stats.token_sources[0]
    check_rounds(out.jetspec_stats, new_tokens(out.sequences, ids.shape[1]))
    assert "both" in sources and "head" in sources and "lookup" not in sources  # the head offers every right token


class StopOn(StoppingCriteria):
    """Stops a row once its last token is `token` (checked after every committed token, not on the device)."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("eos", [False, True])
def test_rows_that_stop_apart_keep_one_source_per_output_token(eos):
    # rows stop at different lengths. With an EOS a finished row leaves and is padded; without one (a user
    # criterion), a row that stopped goes on decoding until every row has, and its tokens past the output's end (a
    # round may run past it) are cut from the output and from its sources alike
    target = tiny_target("llama")
    ids, mask = repeating(3)
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    stop = int(plain[1, ids.shape[1] + 6])  # row 1 stops at its 7th new token (other rows where it comes, if)
    options = (
        dict(eos_token_id=stop, pad_token_id=0) if eos else dict(stopping_criteria=StoppingCriteriaList([StopOn(stop)]))
    )
    reference = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=30, **options)
    head = oracle_head(target, plain, mask, mode="always", tree_budget=8, tree_lookup=4)
    out = generate(target, ids, mask, assistant_model=head, max_new_tokens=30, **options)
    assert torch.equal(out.sequences, reference)
    rows = new_tokens(out.sequences, ids.shape[1], stop if eos else None)
    assert len({len(row) for row in rows}) > 1 or not eos  # with an EOS the rows really end apart
    check_rounds(out.jetspec_stats, rows)


def test_the_chain_verifier_of_a_hybrid_target_keeps_the_sources():
    from test_architectures import VOCAB
    from test_hybrid import hybrid_target

    target = hybrid_target("qwen3_5_text")
    ids, mask = repeating(3, vocab_size=VOCAB)
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    never = oracle_head(target, plain, mask, mode="never", tree_lookup=6)
    out = generate(target, ids, mask, assistant_model=never, tree_verify="chain", max_new_tokens=20)
    assert torch.equal(out.sequences, plain)
    stats, rows = out.jetspec_stats, new_tokens(out.sequences, ids.shape[1])
    check_rounds(stats, rows)
    assert stats.token_sources == by_rounds(stats, rows, "lookup")
    assert any("lookup" in sources for sources in stats.token_sources)


@pytest.mark.parametrize("batch", [1, 2])
def test_a_sampled_call_records_its_walk_s_sources(batch):
    # sampling through a processor (top_k=1: the greedy token, so an always-right head is right): acceptance walks
    # each row's tree on the host, and the record follows the same rule
    target = tiny_target("llama")
    ids, mask = repeating(batch)
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    head = oracle_head(target, plain, mask, mode="always", tree_budget=8, tree_lookup=0)
    out = generate(target, ids, mask, assistant_model=head, do_sample=True, top_k=1, max_new_tokens=16)
    assert torch.equal(out.sequences, plain)
    stats, rows = out.jetspec_stats, new_tokens(out.sequences, ids.shape[1])
    check_rounds(stats, rows)
    assert stats.token_sources == by_rounds(stats, rows, "head")
    assert all("head" in sources for sources in stats.token_sources)
