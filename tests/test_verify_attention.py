"""The verify forward's attention function (`modeling_jetspec/verify_attention.py`): a flex_attention target on CPU
verifies with the flex op uncompiled, which computes the masked attention where torch 2.13's compiled CPU kernel
did not (NaN at 3 queries after 5 keys, errors up to 1.1 at 13 tree queries after 27 keys, on an AVX2 host)."""

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex
from torch.nn.attention.flex_attention import create_block_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from modeling_jetspec.grouped_attention import GROUPED_SDPA
from modeling_jetspec.verify_attention import (
    FLEX_UNCOMPILED,
    attention_function,
    flex_attention_uncompiled,
    verify_attention_of,
)
from jetspec.tiny import oracle_head, prompts, tiny_target


class Layer(torch.nn.Module):
    num_key_value_groups = 1


def tree_allowed(cached: int, parents: list[int]) -> torch.Tensor:
    """`(1, T, cached + T)`: node i sees every cached entry, its ancestors and itself."""
    t = len(parents)
    seen = torch.zeros(t, t, dtype=torch.bool)
    for i in range(t):
        j = i
        while j >= 0:
            seen[i, j], j = True, parents[j]
    return torch.cat([torch.ones(t, cached, dtype=torch.bool), seen], dim=1)[None]


def reference(q, k, v, allowed, scale, softcap=None):
    """Masked attention in float64, written out: scores, soft cap, mask, softmax, weighted sum; `(B, L, h, D)`."""
    groups = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(groups, dim=1) for x in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).float()


TREES = {
    "3 nodes after 5": (5, [-1, 0, 1]),  # compiled: NaN in every trial
    "13 nodes after 27": (27, [-1, 0, 0, 2, 0, 4, 2, 6, 0, 0, 6, 8, 2]),  # compiled: NaN, rows off by 0.5
}


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("heads,kv_heads,softcap", [(4, 4, None), (6, 2, None), (4, 2, 5.0)])
def test_uncompiled_flex_is_the_masked_attention(tree, heads, kv_heads, softcap):
    cached, parents = TREES[tree]
    allowed = tree_allowed(cached, parents)
    t, s = allowed.shape[1:]
    g = torch.Generator().manual_seed(len(parents) + heads)
    q = torch.randn(1, heads, t, 16, generator=g)
    k, v = (torch.randn(1, kv_heads, s, 16, generator=g) for _ in range(2))
    block_mask = create_block_mask(lambda b, h, i, j: allowed[b, i, j], B=1, H=None, Q_LEN=t, KV_LEN=s, device="cpu")
    out, weights = flex_attention_uncompiled(Layer(), q, k, v, block_mask, scaling=0.25, softcap=softcap)
    assert weights is None and out.shape == (1, t, heads, 16)
    torch.testing.assert_close(out, reference(q, k, v, allowed, 0.25, softcap), rtol=1e-5, atol=1e-5)


def test_a_float_mask_goes_to_transformers_flex_function(monkeypatch):
    seen = []
    theirs = ALL_ATTENTION_FUNCTIONS["flex_attention"]
    monkeypatch.setitem(
        ALL_ATTENTION_FUNCTIONS._global_mapping, "flex_attention", lambda *a, **k: seen.append(1) or ("theirs", None)
    )
    q = k = v = torch.zeros(1, 2, 3, 4)
    assert flex_attention_uncompiled(Layer(), q, k, v, torch.zeros(1, 1, 3, 3)) == ("theirs", None)
    assert seen == [1] and theirs is not None


def test_the_verify_picks_its_attention_function():
    assert verify_attention_of(tiny_target("llama")) == GROUPED_SDPA  # 4 query heads over 2 key/value heads
    assert verify_attention_of(tiny_target("llama", num_key_value_heads=4)) is None
    assert verify_attention_of(tiny_target("llama", attn_implementation="flex_attention")) == FLEX_UNCOMPILED
    eager = tiny_target("llama")
    eager.set_attn_implementation("eager")
    assert verify_attention_of(eager) is None
    assert FLEX_UNCOMPILED in ALL_ATTENTION_FUNCTIONS


def test_attention_function_is_restored_after_the_block():
    target = tiny_target("llama", attn_implementation="flex_attention")
    with pytest.raises(RuntimeError):
        with attention_function(target, FLEX_UNCOMPILED):
            assert target.config._attn_implementation == FLEX_UNCOMPILED
            raise RuntimeError("a failing forward")
    assert target.config._attn_implementation == "flex_attention"


def test_a_cpu_flex_target_verifies_through_the_uncompiled_op(monkeypatch):
    """Every verify forward of a tree call on a CPU flex_attention target runs the uncompiled function in every
    layer, on a BlockMask; the prefill keeps transformers' flex function (the cache plain `generate` writes), and the
    output is plain greedy's (transformers' function runs the op uncompiled here too: the tree test in
    test_lossless.py holds the compiled case)."""
    import transformers.integrations.flex_attention as transformers_flex

    monkeypatch.setattr(
        transformers_flex,
        "compile_friendly_flex_attention",
        lambda q, k, v, training=False, **kw: torch_flex.flex_attention(q, k, v, **kw),
    )
    ours, theirs = [], []
    mapping = ALL_ATTENTION_FUNCTIONS._global_mapping
    for name, seen in ((FLEX_UNCOMPILED, ours), ("flex_attention", theirs)):
        function = mapping[name]
        monkeypatch.setitem(mapping, name, lambda *a, _f=function, _s=seen, **k: _s.append(a[4]) or _f(*a, **k))
    target = tiny_target("llama", attn_implementation="flex_attention")
    ids, mask = prompts(1)
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    assert ours == [] and theirs
    theirs.clear()
    oracle = oracle_head(target, plain, mask, mode="sometimes", tree_depth=3, tree_width=2, tree_budget=6)
    out = target.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12, assistant_model=oracle
    )
    assert torch.equal(out, plain)
    layers = target.config.num_hidden_layers
    stats = oracle.last_stats
    assert stats.rounds > 1 and stats.tau > 1.0  # rounds that accepted drafted nodes
    assert len(ours) == layers * stats.rounds and all(isinstance(m, torch_flex.BlockMask) for m in ours)
    assert len(theirs) == layers * (stats.target_forwards - stats.rounds)  # the prefill
    assert target.config._attn_implementation == "flex_attention"
