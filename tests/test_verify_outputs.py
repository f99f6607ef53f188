"""What the target hands a round: only the hidden states the head reads, and logits in the target's own dtype
(greedy acceptance takes their argmax; no fp32 copy of the `(rows, nodes, vocab)` logits)."""

import pytest
import torch
from jetspec.tiny import prompts, tiny_head, tiny_target
from torch.overrides import TorchFunctionMode

import modeling_jetspec.decode as decode
from modeling_jetspec import JetSpecDraftModel
from modeling_jetspec.steps import feature_layers


def greedy(target, ids, mask, **kwargs):
    return target.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kwargs)


@pytest.mark.parametrize("layers", [[0, 2], [3], [0, 1, 2, 3]], ids=["two", "last", "all"])
def test_the_target_returns_only_the_layers_the_head_reads(layers):
    target = tiny_target("llama", num_hidden_layers=4)
    head = tiny_head(target, target_layer_ids=layers)
    ids, mask = prompts(2)
    plain = greedy(target, ids, mask, max_new_tokens=12)
    returned = []
    hook = target.register_forward_hook(lambda module, args, out: returned.append(out.hidden_states))
    tree = greedy(target, ids, mask, max_new_tokens=12, assistant_model=head)
    hook.remove()
    assert torch.equal(tree, plain)
    assert len(returned) == head.last_stats.target_forwards >= 3  # the prefill and every verify
    wanted = {i + 1 for i in layers}  # hidden_states[i + 1] is layer i's output; 0 is the embeddings
    assert sorted(wanted) == feature_layers(head)
    for states in returned:
        assert len(states) == 5  # transformers keeps the indexing: a None where a layer was not asked for
        assert {i for i, state in enumerate(states) if state is not None} == wanted


class LargestFloat32(TorchFunctionMode):
    """The most elements of any float32 tensor a torch call returns inside the mode."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def largest_float32_in_rounds(monkeypatch, target, head, ids, **kwargs) -> int:
    seen = LargestFloat32()
    original = decode._round

    def watched(*args, **kw):
        with seen:
            return original(*args, **kw)

    monkeypatch.setattr(decode, "_round", watched)
    with torch.no_grad():
        target.generate(input_ids=ids, max_new_tokens=8, assistant_model=head, **kwargs)
    return seen.largest


@pytest.mark.parametrize(
    "settings",
    [
        dict(do_sample=False),
        dict(do_sample=False, return_dict_in_generate=True, output_logits=True),
        dict(do_sample=True, top_k=20),
    ],
    ids=["greedy", "output_logits", "sampling"],
)
def test_a_bfloat16_round_never_copies_the_verify_logits_to_float32(settings, monkeypatch):
    """The verify's logits of a bf16 target stay bf16: greedy acceptance takes their argmax (bf16 -> fp32 is exact, so
    the argmax is the same), and only the nodes a record or a processor reads are upcast, one `(V,)` row each."""
    target = tiny_target("llama").to(torch.bfloat16)
    torch.manual_seed(1)
    head = JetSpecDraftModel.from_target(target).eval().to(torch.bfloat16)  # budget 32: 33 nodes verified
    ids, _ = prompts(2, lengths=(9, 9))
    vocab, nodes = target.config.vocab_size, head.config.tree_budget + 1
    largest = largest_float32_in_rounds(monkeypatch, target, head, ids, **settings)
    # the head's own logits (2, depth + 1 slots, V) are fp32; a copy of the verify's would be (2, 33, V)
    assert 0 < largest < 2 * nodes * vocab
    # (e) the instrument sees such a copy when one is made
    with LargestFloat32() as seen:
        torch.zeros(2, nodes, vocab, dtype=torch.bfloat16).float()
    assert seen.largest == 2 * nodes * vocab
