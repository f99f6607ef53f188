"""JetSpec tree speculative decoding as a `custom_generate` recipe.

    target.generate(**inputs, custom_generate="<this repo>", trust_remote_code=True, max_new_tokens=256)

loads the JetSpec head stored in this repo (once per process) and decodes losslessly with it. Pass
`jetspec_head=<a loaded head>` to reuse a head you already hold.
"""

import sys

from transformers import AutoModel

_HEADS = {}


def _calling_repo():
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "generate" and isinstance(frame.f_locals.get("custom_generate"), str):
            return frame.f_locals["custom_generate"]
        frame = frame.f_back
    raise ValueError("expected to be called from `generate(..., custom_generate=<repo>)`, got another caller")


def generate(model, *args, jetspec_head=None, **kwargs):
    head = jetspec_head
    if head is None:
        repo = _calling_repo()
        if repo not in _HEADS:
            _HEADS[repo] = AutoModel.from_pretrained(repo, trust_remote_code=True)
        head = _HEADS[repo].to(device=model.device, dtype=model.dtype)
    return head.tree_generate(model, *args, **kwargs)
