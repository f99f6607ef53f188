"""The verify forward reads grouped keys/values in place (`modeling_jetspec/grouped_attention.py`): no copy of the
cache per round, the same attention to float32 rounding, outputs equal to plain `generate`, and every other case left
to transformers' own sdpa function."""

import pytest
import torch
import transformers.integrations.sdpa_attention as transformers_sdpa
from test_architectures import HYBRID_FAMILIES, family_target
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from modeling_jetspec.compat import decoder_attention_implementation
from modeling_jetspec.grouped_attention import GROUPED_SDPA, sdpa_grouped, uses_grouped_attention
from jetspec.tiny import ARCHITECTURES, oracle_head, prompts, tiny_head, tiny_target


class Copies:
    """How many times transformers' sdpa function copied key/value heads (`repeat_kv`) with more than one group."""

    def __init__(self, monkeypatch):
        self.count = 0
        repeat = transformers_sdpa.repeat_kv

        def counting(hidden_states, n_rep):
            self.count += n_rep > 1
            return repeat(hidden_states, n_rep)

        monkeypatch.setattr(transformers_sdpa, "repeat_kv", counting)


def greedy(target, ids, mask, **kwargs):
    return target.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kwargs)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tree_decoding_copies_no_key_values_and_keeps_plain_greedy(arch, monkeypatch):
    target = tiny_target(arch)
    assert uses_grouped_attention(target)
    ids, mask = prompts(1)
    plain = greedy(target, ids, mask, max_new_tokens=24)
    copies = Copies(monkeypatch)
    oracle = oracle_head(target, plain, mask, mode="sometimes")
    out = greedy(target, ids, mask, max_new_tokens=24, assistant_model=oracle)
    assert torch.equal(out, plain)
    assert oracle.last_stats.rounds > 3 and oracle.last_stats.tau > 1.5
    # before the change each verify copied every layer's keys/values (one count per layer per round)
    assert copies.count == 0
    assert decoder_attention_implementation(target) == "sdpa"  # restored after the call


@pytest.mark.parametrize("batch", [2, 3])
def test_padded_batches_keep_plain_greedy(batch):
    target = tiny_target("mistral")  # sliding window: a windowed tree mask
    ids, mask = prompts(batch)
    plain = greedy(target, ids, mask, max_new_tokens=20)
    for head in (tiny_head(target), oracle_head(target, plain, mask, mode="sometimes")):
        assert torch.equal(greedy(target, ids, mask, max_new_tokens=20, assistant_model=head), plain)


def test_hybrid_shared_rows_attention_keeps_plain_greedy(monkeypatch):
    family = "qwen3_5_text"
    target = family_target(family, *HYBRID_FAMILIES[family])
    ids, mask = prompts(2)
    plain = greedy(target, ids, mask, max_new_tokens=16)
    calls = []
    monkeypatch.setattr(
        "modeling_jetspec.shared_past.sdpa_grouped", lambda *a, **k: calls.append(1) or sdpa_grouped(*a, **k)
    )
    oracle = oracle_head(target, plain, mask, mode="sometimes")
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=16, assistant_model=oracle), plain)
    assert calls, "the hybrid verifier's shared-rows attention did not reach sdpa_grouped"


class Layer(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups


def _inputs(groups, mask_kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2 * groups, 5, 8, generator=g)
    k, v = (torch.randn(2, 2, 11, 8, generator=g) for _ in range(2))
    allowed = torch.rand(2, 1, 5, 11, generator=g) > 0.3
    allowed[..., 0] = True  # every query sees at least one entry
    if mask_kind == "bool":
        return q, k, v, allowed
    if mask_kind == "float":
        return q, k, v, torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return q, k, v, None


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_same_attention_as_transformers_sdpa_to_float32_rounding(mask_kind):
    q, k, v, mask = _inputs(3, mask_kind)
    ours, weights = sdpa_grouped(Layer(3), q, k, v, mask, scaling=0.3)
    theirs, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](Layer(3), q, k, v, mask, scaling=0.3)
    assert weights is None and ours.shape == theirs.shape == (2, 5, 6, 8)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "groups,mask_kind,extra",
    [(1, "float", {}), (3, None, {}), (3, "float", {"position_bias": torch.zeros(1, 6, 5, 11)})],
)
def test_other_cases_go_to_transformers_sdpa_unchanged(groups, mask_kind, extra, monkeypatch):
    q, k, v, mask = _inputs(groups, mask_kind)
    seen = []
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    spy = {"sdpa": lambda *a, **kw: seen.append(1) or sdpa(*a, **kw)}
    monkeypatch.setattr("modeling_jetspec.grouped_attention.ALL_ATTENTION_FUNCTIONS", spy)
    ours, _ = sdpa_grouped(Layer(groups), q, k, v, mask, **extra)
    assert seen == [1]
    assert torch.equal(ours, sdpa(Layer(groups), q, k, v, mask, **extra)[0])


def test_only_grouped_sdpa_targets_switch():
    assert uses_grouped_attention(tiny_target("llama"))
    assert not uses_grouped_attention(tiny_target("llama", num_key_value_heads=4))  # one query head per kv head
    eager = tiny_target("llama")
    eager.set_attn_implementation("eager")
    assert not uses_grouped_attention(eager)
    assert GROUPED_SDPA in ALL_ATTENTION_FUNCTIONS
