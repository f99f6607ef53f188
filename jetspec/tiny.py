"""Tiny random targets built in-process (fp32, CPU, no network) and drafters of known quality: what the tests decode
with, and what the measuring scripts' smoke runs (`--target tiny...`) time, so both build the same models.

    target = tiny_target("qwen3")                          # 2 layers, hidden 64, vocabulary 128, seeded
    head = tiny_head(target, tree_budget=8)                # a random head of that target
    input_ids, attention_mask = prompts(2)                 # left-padded random prompts
"""

import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from modeling_jetspec import JetSpecDraftModel

ARCHITECTURES = ("llama", "qwen3", "qwen3_moe", "mistral")


def tiny_target(arch: str = "llama", vocab_size: int = 128, seed: int = 0, **overrides):
    """A 2-layer random decoder of the given family, eval mode, sdpa attention."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation="sdpa",
    )
    common.update(overrides)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    elif arch == "qwen3_moe":
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **common)
        )
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**{"sliding_window": 256, **common}))
    elif arch == "deepseek_v3":  # multi-head latent attention: a layer caches keys and values of different last sizes
        model = DeepseekV3ForCausalLM(
            DeepseekV3Config(
                **{**common, "num_key_value_heads": 4},
                kv_lora_rank=16,
                q_lora_rank=None,
                qk_nope_head_dim=8,
                qk_rope_head_dim=8,
                v_head_dim=12,
                n_routed_experts=4,
                num_experts_per_tok=2,
                n_shared_experts=1,
                moe_intermediate_size=32,
                n_group=1,
                topk_group=1,
                first_k_dense_replace=1,
            )
        )
    else:
        raise ValueError(f"unknown test architecture {arch!r}")
    return model.eval()


def tiny_head(target, seed: int = 1, **overrides):
    torch.manual_seed(seed)
    fields = dict(num_hidden_layers=1, block_size=8, tree_depth=4, tree_width=3, tree_budget=12)
    fields.update(overrides)
    return JetSpecDraftModel.from_target(target, **fields).eval()


class OracleHead(JetSpecDraftModel):
    """A drafter that knows the target's greedy continuation (`reference`, left-padded rows as `generate` returns).

    mode "always": slot at absolute position p puts all mass on the reference token at p (always right).
    mode "never": the reference token gets the lowest logit (never drafted), so every round commits only the bonus.
    mode "sometimes": at position p the reference token is ranked `sometimes_rank(p)` (0, 1 or 2) behind decoys
    that hold more mass, so the accepted path runs through second and third children: its nodes are not the
    tree's first nodes 1..D, and a compaction that assumed contiguous nodes would keep the wrong entries.
    """

    reference: torch.Tensor = None  # (batch, length)
    pads: list = None  # left pads per row
    mode: str = "always"

    def draft(self, input_ids, position_ids, *args, **kwargs):
        out = super().draft(input_ids, position_ids, *args, **kwargs)
        # always: the right token holds all the mass; never: the right token is the least likely of all, so no
        # top-W set (W < vocab) contains it
        logits = torch.full_like(out.logits, 0.0 if self.mode == "never" else -1e4)
        vocab = logits.shape[-1]
        for i, row in enumerate(self._rows_of(input_ids, position_ids)):
            ref = self.reference[row]
            for t in range(input_ids.shape[1]):
                index = self.pads[row] + int(position_ids[i, t])
                token = int(ref[index]) if index < ref.shape[0] else 0
                if self.mode == "never":
                    logits[i, t, token] = -1e9
                    continue
                logits[i, t, token] = 0.0
                if self.mode == "sometimes":
                    for j in range(sometimes_rank(int(position_ids[i, t]))):  # decoys ranked above the reference
                        logits[i, t, (token + 1 + j) % vocab] = 1.0 - 0.25 * j
        out.logits = logits
        return out

    def _rows_of(self, input_ids, position_ids):
        """Batch rows still decoding keep their order: match each to the next reference row holding its anchor."""
        rows, start = [], 0
        for i in range(input_ids.shape[0]):
            anchor, pos = int(input_ids[i, 0]), int(position_ids[i, 0])
            row = next(
                (r for r in range(start, len(self.pads)) if int(self.reference[r, self.pads[r] + pos]) == anchor),
                start,
            )
            rows.append(row)
            start = row + 1
        return rows


def sometimes_rank(position: int) -> int:
    """Rank of the reference token in the "sometimes" oracle's distribution at an absolute position."""
    return (position * 7) % 3


def oracle_head(target, reference, attention_mask, mode="always", **overrides):
    fields = dict(num_hidden_layers=1, block_size=8, tree_depth=4, tree_width=3, tree_budget=12)
    fields.update(overrides)
    head = OracleHead.from_target(target, **fields).eval()
    head.reference = torch.nn.functional.pad(reference, (0, 64))  # room for drafts past the end
    head.pads = (attention_mask == 0).sum(-1).tolist()
    head.mode = mode
    return head


def prompts(batch: int, lengths=(9, 5, 13), vocab_size: int = 128, seed: int = 0):
    """Left-padded random prompts of different lengths: `(input_ids, attention_mask)`, pad id 0."""
    g = torch.Generator().manual_seed(seed)
    longest = max(lengths[:batch])
    ids = torch.zeros(batch, longest, dtype=torch.long)
    mask = torch.zeros(batch, longest, dtype=torch.long)
    for row in range(batch):
        n = lengths[row]
        ids[row, longest - n :] = torch.randint(1, vocab_size, (n,), generator=g)
        mask[row, longest - n :] = 1
    return ids, mask


def tiny_tokenizer(vocab_size: int = 128):
    """A byte-pair tokenizer over the letters a-k and their pairs (`vocab_size` ids, id 0 `<pad>`), built in-process:
    enough for `stop_strings` and `TextStreamer`."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    letters = "abcdefghijk"
    vocab = {"<pad>": 0, **{a: 1 + i for i, a in enumerate(letters)}}
    for pair in (a + b for a in letters for b in letters):
        if len(vocab) < vocab_size:
            vocab[pair] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[(p[0], p[1]) for p in vocab if len(p) == 2]))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>")
