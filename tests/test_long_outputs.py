"""Long outputs: the cache columns no row reads again are reclaimed (modeling_jetspec/reclaim.py).

Settings:
  (a) packing every round (whatever it frees) keeps the output equal to plain greedy, token for token, in float32:
      batches of 2-4 ragged rows whose acceptance differs every round (oracle "sometimes", a random head with the
      trie), a full-attention target and a target whose every layer slides (window 16, far shorter than the output);
  (b) at the default thresholds, after every round the cache frees less than it would pack (width - live columns
      below max(MIN_RECLAIM, width / 4)), so at batch > 1 it stays within 4/3 of its longest live row (or
      MIN_RECLAIM above it) instead of growing by the batch's longest acceptance every round;
  (c) with a sliding window on every layer the cache holds the window (plus at most MIN_RECLAIM columns), whatever
      the output's length; the unpacked cache would hold every entry.
"""

import pytest
import torch

import modeling_jetspec.reclaim as reclaim_module
import modeling_jetspec.verifiers as verifiers
from modeling_jetspec.reclaim import MIN_RECLAIM, live_columns, packed_order
from jetspec.tiny import oracle_head, prompts, tiny_head, tiny_target

WINDOW = 16


def greedy(target, ids, mask, **kwargs):
    return target.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kwargs)


def target_for(arch: str):
    if arch == "mistral":  # every layer slides
        return tiny_target("mistral", sliding_window=WINDOW)
    return tiny_target(arch)


def widths(monkeypatch, window=None):
    """Spy on every round's reclaim: `(cache width, longest live row, head context width)` after it."""
    seen = []
    original = verifiers.reclaim

    def spy(state, window=None, live_bound=None, force=False):
        state = original(state, window, live_bound, force)
        if not state.rows.numel():  # the last rows left
            return state
        live = live_columns(state, window)
        seen.append((state.valid.shape[1], int(live.sum(1).max()), state.context.valid.shape[1]))
        for layer in state.cache.layers:  # the cache and the state agree on the width
            assert layer.keys.shape[-2] == state.valid.shape[1]
        return state

    monkeypatch.setattr(verifiers, "reclaim", spy)
    return seen


CASES = [("llama", 2, "sometimes"), ("llama", 4, "trie"), ("mistral", 3, "sometimes"), ("mistral", 2, "trie")]


@pytest.mark.parametrize("arch,batch,drafter", CASES, ids=[f"{a}-bs{b}-{d}" for a, b, d in CASES])
def test_packing_every_round_is_lossless(monkeypatch, arch, batch, drafter):  # (a)
    target = target_for(arch)
    ids, mask = prompts(batch, lengths=(9, 5, 13, 7))
    plain = greedy(target, ids, mask, max_new_tokens=200)
    if drafter == "sometimes":
        head = oracle_head(target, plain, mask, mode="sometimes", tree_budget=10)
    else:
        head = tiny_head(target, tree_budget=8, tree_lookup=6, tree_lookup_branches="trie")
    monkeypatch.setattr(reclaim_module, "should_pack", lambda width, packed: True)
    seen = widths(monkeypatch)
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=200, assistant_model=head), plain)
    assert len(seen) > 10
    # every round packed: the cache is as wide as its longest live row, up to the left padding the host's bound
    # counts as live (prompts of 5 to 13 tokens)
    assert all(live <= width <= live + 8 for width, live, _ in seen), seen


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_cache_width_stays_bounded(monkeypatch, arch):  # (b), (c)
    target = target_for(arch)
    ids, mask = prompts(4, lengths=(9, 5, 13, 7))
    plain = greedy(target, ids, mask, max_new_tokens=300)
    head = oracle_head(target, plain, mask, mode="sometimes", tree_budget=10)
    window = WINDOW if arch == "mistral" else None
    seen = widths(monkeypatch, window)
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=300, assistant_model=head), plain)
    for width, live, _ in seen:
        freed = width - live
        assert freed < MIN_RECLAIM or 4 * freed < width, (width, live)
    if arch == "mistral":
        assert max(width for width, _, _ in seen) < WINDOW - 1 + MIN_RECLAIM
        assert max(live for _, live, _ in seen) <= WINDOW - 1  # what a later query can see
    else:
        width, live, _ = seen[-1]
        assert width <= max(4 * live // 3 + 1, live + MIN_RECLAIM)


def test_packed_order_keeps_live_entries_in_order():
    live = torch.tensor([[False, True, False, True, True], [True, False, False, False, True]])
    index = packed_order(live, 3)
    assert index[0].tolist() == [1, 3, 4]  # its live columns, in order
    assert live.gather(1, index)[1].tolist() == [False, True, True] and index[1, 1:].tolist() == [0, 4]


def test_long_rounds_script_reports_every_length(capsys):
    """scripts/long_rounds.py at small sizes: a line per target, batch and length, and the growth."""
    from scripts.long_rounds import main

    assert main(["--lengths", "48,96", "--batches", "1,2", "--span", "24"]) == 0
    printed = capsys.readouterr().out
    blocks = {}
    for line in printed.splitlines():
        if not line.startswith(" "):
            key = (line.split(" (")[0], line.split("batch ")[1].split(":")[0])
        blocks.setdefault(key, []).append(line.strip())
    assert sorted(blocks) == [("llama", "1"), ("llama", "2"), ("mistral", "1"), ("mistral", "2")]
    for lines in blocks.values():
        assert [line.split(" tokens:")[0] for line in lines[1:3]] == ["48", "96"], lines
        assert all(all(part in line for part in ("host", "draft", "verify", "width")) for line in lines[1:3])
        assert lines[3].startswith("growth 48 -> 96")
