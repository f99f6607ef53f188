"""Forward rows that share their batch row's attention past (`modeling_jetspec/shared_past.py`) attend exactly as
rows holding a copy of that past would: the same keys seen, the others weighing 0."""

import torch
import torch.nn.functional as F

from modeling_jetspec.shared_past import SharedPastLayer, SharedRows, shared_rows_attention
from modeling_jetspec.tree import verification_mask


class Module:  # what transformers' sdpa reads from an attention layer
    num_key_value_groups = 2
    is_causal = True


@torch.no_grad()
def test_rows_sharing_a_past_attend_as_rows_with_a_copy():
    g = torch.Generator().manual_seed(0)
    h_kv, groups, d, past, length = 2, 2, 8, 11, 4
    source = [0, 0, 1, 0, 1]  # forward rows: three continue batch row 0, two continue batch row 1
    keys, values = torch.randn(2, h_kv, past, d, generator=g), torch.randn(2, h_kv, past, d, generator=g)
    valid = torch.rand(2, past, generator=g) > 0.3  # holes and padding in the past
    seen = torch.ones(length, length, dtype=torch.bool).tril().expand(2, length, length)
    mask = verification_mask(valid, seen, torch.float32)  # (2, 1, L, S + L): each batch row's own
    rows = SharedRows.of(source, 2, length, "cpu").with_mask(mask)
    assert rows.slots == 3 and rows.slot.tolist() == [0, 1, 0, 2, 1]
    layer = SharedPastLayer(keys, values, rows)
    new_k = torch.randn(5, h_kv, length, d, generator=g)
    new_v = torch.randn(5, h_kv, length, d, generator=g)
    query = torch.randn(5, h_kv * groups, length, d, generator=g)
    k, v = layer.update(new_k, new_v)
    assert k.shape == (2, h_kv, past + 3 * length, d)
    out, weights = shared_rows_attention(Module(), query, k, v, rows, scaling=d**-0.5)
    assert weights is None and out.shape == (5, length, h_kv * groups, d)
    for r, s in enumerate(source):  # each forward row alone, with a copy of its batch row's past
        copy_k = torch.cat([keys[s], new_k[r]], dim=1)[None]
        copy_v = torch.cat([values[s], new_v[r]], dim=1)[None]
        alone = F.scaled_dot_product_attention(
            query[r : r + 1], copy_k, copy_v, attn_mask=mask[s : s + 1], enable_gqa=True, scale=d**-0.5
        )
        # the same sums over the same keys; the shared row's masked keys add exact zeros (fp32 order: ~1e-7)
        torch.testing.assert_close(out[r], alone[0].transpose(0, 1), rtol=1e-5, atol=1e-6)
    # every forward row's new keys are read back where they were laid out
    src, slot = rows.source, rows.slot
    read_k, _ = layer.entries(src, slot, torch.full((5,), length - 1))
    assert torch.equal(read_k, new_k[:, :, length - 1])
