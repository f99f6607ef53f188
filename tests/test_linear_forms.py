"""The verify's linear layers in another GEMM form (`verify_linear`, `modeling_jetspec/linear_forms.py`): outputs
equal plain `generate` with the form forced on, plain decoding untouched, the "auto" probe cached per host."""

import json
import types

import pytest
import torch

import modeling_jetspec.linear_forms as linear_forms
import modeling_jetspec.steps as steps
from modeling_jetspec.linear_forms import LinearForms, mm_linear
from modeling_jetspec.state import resolve_tree_shape
from modeling_jetspec.verifiers import verifier_for
from jetspec.tiny import ARCHITECTURES, oracle_head, prompts, tiny_head, tiny_target


def greedy(target, ids, mask, **kwargs):
    return target.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kwargs)


class LinearCalls:
    """How many linear calls ran in the mm form (counted around `linear_forms.mm_linear`)."""

    def __init__(self, monkeypatch):
        self.mm = 0
        mm = linear_forms.mm_linear

        def counting_mm(*args):
            self.mm += 1
            return mm(*args)

        monkeypatch.setattr(linear_forms, "mm_linear", counting_mm)


@pytest.mark.parametrize("arch", [*ARCHITECTURES, "deepseek_v3"])
@pytest.mark.parametrize("batch", [1, 3])
def test_mm_form_keeps_plain_greedy_s_tokens(arch, batch, monkeypatch):
    target = tiny_target(arch)
    ids, mask = prompts(batch)
    plain = greedy(target, ids, mask, max_new_tokens=20)
    calls = LinearCalls(monkeypatch)
    head = tiny_head(target)
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=20, assistant_model=head, verify_linear="mm"), plain)
    oracle = oracle_head(target, plain, mask, mode="sometimes")
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=20, assistant_model=oracle, verify_linear="mm"), plain)
    assert oracle.last_stats.tau > 1.5  # accepted paths through later siblings
    linears = sum(type(m) is torch.nn.Linear for m in target.modules())
    verifies = head.last_stats.rounds + oracle.last_stats.rounds
    assert calls.mm >= linears * verifies  # every linear of every verify (MoE experts may run more than once)
    # afterwards the model is as it was: no forward left on an instance, plain decoding reads F.linear
    assert not any("forward" in vars(m) for m in target.modules() if type(m) is torch.nn.Linear)
    before = calls.mm
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=20), plain) and calls.mm == before


def test_both_forms_give_the_verify_the_same_logits_to_float32_rounding():
    """What "lossless" rests on for this change: a verify's logits in the mm form equal F.linear's up to float32
    rounding (a different summation order), so greedy acceptance reads the target's own logits either way."""
    target = tiny_target("llama")
    head = tiny_head(target)
    ids, mask = prompts(2)
    head.attach_target(target)
    shape = resolve_tree_shape(head.config)
    outs = {}
    for mode in ("linear", "mm"):
        verifier = verifier_for(target, head, verify_linear=mode)
        state, _ = verifier.prefill(ids, mask)
        trees = steps.draft(head, state, shape, shape.budget)
        outs[mode] = verifier.verify(state, trees)[1]  # (2, 13, V) logits
    torch.testing.assert_close(outs["mm"], outs["linear"], rtol=1e-5, atol=1e-5)
    assert torch.equal(outs["mm"].argmax(-1), outs["linear"].argmax(-1))


def test_mm_linear_is_linear_with_and_without_bias():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 5, 16, generator=g), torch.randn(24, 16, generator=g), torch.randn(24, generator=g)
    for bias in (None, b):
        out = mm_linear(x, w, bias)
        assert out.shape == (2, 5, 24) and out.is_contiguous()
        torch.testing.assert_close(out, torch.nn.functional.linear(x, w, bias))


def test_auto_probes_each_shape_once_per_host_and_caches_it(tmp_path, monkeypatch):
    monkeypatch.setenv("JETSPEC_HOST_CACHE", str(tmp_path / "host.json"))
    probed = []

    def probe(weight, bias, rows):
        probed.append((tuple(weight.shape), rows))
        return "mm" if weight.shape[0] == 128 else "linear"  # the LM head in one form, the rest in the other

    target = tiny_target("llama")
    ids, mask = prompts(1)
    plain = greedy(target, ids, mask, max_new_tokens=12)
    monkeypatch.setattr(linear_forms, "probe_form", probe)
    forms = LinearForms("auto", probe=probe)
    monkeypatch.setattr(steps, "linear_forms", _recording(forms))
    head = tiny_head(target)
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=12, assistant_model=head), plain)
    shapes = {tuple(m.weight.shape) for m in target.modules() if type(m) is torch.nn.Linear}
    assert {shape for shape, _ in probed} == shapes and {rows for _, rows in probed} == {13}  # root + 12 nodes
    assert len(probed) == len(set(probed))  # once per shape and row count
    stored = json.loads((tmp_path / "host.json").read_text())
    ((key, table),) = stored.items()
    assert key.startswith("verify linear|") and table["128x64@13 float32"] == "mm" and "64x64@13 float32" in table
    # a new call on this host reads the decisions back: no probe
    probed.clear()
    assert torch.equal(greedy(target, ids, mask, max_new_tokens=12, assistant_model=head), plain)
    assert probed == []


def _recording(forms):
    """`steps.linear_forms` run with `forms` whatever the verifier holds (so the test's probe is the one used)."""
    original = linear_forms.linear_forms

    def patched(target, _forms):
        return original(target, LinearForms("auto", probe=forms.probe))

    return patched


def test_auto_keeps_f_linear_off_the_cpu_and_above_the_row_bound():
    forms = LinearForms("auto", probe=lambda *a: pytest.fail("no probe expected"))
    w = torch.zeros(4, 4)
    assert forms.form(w, None, linear_forms.MAX_ROWS + 1) == "linear"
    meta = types.SimpleNamespace(device=torch.device("meta"))  # a target on another device than the CPU
    assert (
        forms.active(types.SimpleNamespace(device=torch.device("cpu")))
        and not forms.active(meta)
        and LinearForms("mm").active(meta)
        and not LinearForms("linear").active(meta)
    )


def test_unknown_verify_linear_is_refused_by_name():
    target = tiny_target("llama")
    ids, mask = prompts(1)
    with pytest.raises(ValueError, match="expected verify_linear in"):
        greedy(target, ids, mask, max_new_tokens=4, assistant_model=tiny_head(target), verify_linear="fast")
