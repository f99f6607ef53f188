"""JetSpec tree speculative decoding as a `custom_generate` recipe.

    target.generate(**inputs, custom_generate="<this repo>", jetspec_head="<this repo>", trust_remote_code=True,
                    max_new_tokens=256)

`jetspec_head` is the head to decode with: a repo id or folder (loaded once per process with
`AutoModel.from_pretrained(..., trust_remote_code=True)`), or a head you already hold. transformers does not tell a
recipe which repo it was loaded from, so the head is named explicitly.
"""

from transformers import AutoModel

_HEADS = {}


def generate(model, *args, jetspec_head=None, **kwargs):
    if jetspec_head is None:
        raise ValueError(
            "expected jetspec_head=<this repo or folder, or a loaded JetSpec head> with this recipe, got none"
        )
    head = jetspec_head
    if isinstance(head, str):
        if head not in _HEADS:
            _HEADS[head] = AutoModel.from_pretrained(head, trust_remote_code=True)
        head = _HEADS[head].to(device=model.device, dtype=model.dtype)
    return head.tree_generate(model, *args, **kwargs)
