"""The verify's linear layers in the form this host runs fastest (`verify_linear`; issue 34, "the AVX2 verify").

A verify forward multiplies every weight by a few rows (root + tree nodes per row of the batch, 8-32 in practice),
a shape the CPU GEMM kernels treat unevenly: on AVX2-only hosts `torch.mm(W, x.T).T` ran the target's linears at
9 rows in 78-80 ms where `F.linear(x, W)` took 105-119 ms (SmolLM2-135M, float32). [`linear_forms`] runs every
`torch.nn.Linear` of the target in the form chosen for its weight's shape and the forward's row count, during the
verify forward only: plain decoding, the prefill and the head never see it.

- `verify_linear="auto"` (the default): on a CPU, each `(out, in, rows, dtype)` is timed once in both forms (a short
  `torch.utils.benchmark` probe, [`probe_form`]) and the faster one kept, cached per host beside the dtype probe of
  `jetspec/host.py` (the same file, [`host_cache.cache_path`], under `"verify linear|"` + the host key + the thread
  count); above [`MAX_ROWS`] rows, and on other devices, `F.linear`.
- `"mm"`: `torch.mm(W, x.T).T` for every linear (on any device), `"linear"`: `F.linear` (the model as it is).

Exactness. The two forms compute the same products and sums in another order, so their float32 results differ by
rounding only, as a verify forward over n + 1 rows already differs from a one-row decode step (other GEMM blocking,
other attention masks). The guarantee is unchanged: every committed token is the argmax (or a sample) of logits the
target computed over exactly the committed prefix; the output equals plain greedy token for token unless its two
best logits lie within float32 rounding of each other (a float32 tie), as for any verify forward.
`tests/test_linear_forms.py` checks the output against plain `generate` with the form forced on, over the test
architectures and batch sizes, and that a verify's logits in both forms agree to float32 rounding.
"""

import contextlib
import functools

import torch
import torch.nn.functional as F

from .host_cache import cache_path, read_cache, store, this_host_key

VERIFY_LINEAR = ("auto", "linear", "mm")
MAX_ROWS = 64  # "auto" probes verify forwards up to this many rows (a batch x tree); above, F.linear
PROBE_SECONDS = 0.005  # per form and shape (blocked_autorange's minimum run time; a call at least)


def check_verify_linear(mode) -> str:
    if mode not in VERIFY_LINEAR:
        raise ValueError(f"expected verify_linear in {VERIFY_LINEAR}, got {mode!r}")
    return mode


def mm_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed as `torch.mm(weight, x.T).T` (bias added in the same GEMM), returned
    contiguous so any model code reads it as it reads `F.linear`'s output."""
    flat = x.reshape(-1, x.shape[-1])  # (N, in)
    out = torch.mm(weight, flat.t()) if bias is None else torch.addmm(bias[:, None], weight, flat.t())  # (out, N)
    return out.t().contiguous().reshape(*x.shape[:-1], weight.shape[0])


def probe_form(weight: torch.Tensor, bias: torch.Tensor | None, rows: int, seconds: float = PROBE_SECONDS) -> str:
    """`"mm"` when [`mm_linear`] at `rows` rows runs faster than `F.linear` with this weight on this host, else
    `"linear"` (medians of `torch.utils.benchmark` blocks, after a warm-up call of each)."""
    from torch.utils.benchmark import Timer

    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight)
    times = {}
    for name, fn in (("linear", F.linear), ("mm", mm_linear)):
        fn(x, weight, bias)
        timer = Timer("fn(x, w, b)", globals={"fn": fn, "x": x, "w": weight, "b": bias})
        times[name] = timer.blocked_autorange(min_run_time=seconds).median
    return "mm" if times["mm"] < times["linear"] else "linear"


class LinearForms:
    """The forms of a call's verify linears: `mode` (see [`VERIFY_LINEAR`]) and, for "auto", the per-host table of
    `"{out}x{in}@{rows} {dtype}"` -> form, read from the host cache on first use and extended by probes."""

    def __init__(self, mode: str = "auto", probe=probe_form):
        self.mode, self.probe = check_verify_linear(mode), probe
        self.table, self.new, self.key = None, False, None
        self.patches = None  # (the instance dict of a target linear, its patched forward), built on the first verify

    def linears(self, target) -> list:
        """`(module.__dict__, forward)` for each of `target`'s `torch.nn.Linear` modules (exact type, forward not
        already replaced on the instance, e.g. by accelerate's hooks), built once per call: walking a deep model's
        modules and building ~200 bound forwards cost about a millisecond every round."""
        if self.patches is None:
            self.patches = [
                (vars(m), functools.partial(_forward, m, self))
                for m in target.modules()
                if type(m) is torch.nn.Linear and "forward" not in vars(m)
            ]
        return self.patches

    def active(self, target) -> bool:
        """Whether the verify patches the target's linears at all."""
        return self.mode == "mm" or (self.mode == "auto" and target.device.type == "cpu")

    def form(self, weight: torch.Tensor, bias, rows: int) -> str:
        if self.mode != "auto":
            return self.mode
        if rows > MAX_ROWS:
            return "linear"
        if self.table is None:
            self.key = f"verify linear|{this_host_key()}|threads {torch.get_num_threads()}"
            self.table = dict(read_cache(cache_path()).get(self.key, {}))
        entry = f"{weight.shape[0]}x{weight.shape[1]}@{rows} {str(weight.dtype).removeprefix('torch.')}"
        if entry not in self.table:
            self.table[entry] = self.probe(weight, bias, rows)
            self.new = True
        return self.table[entry]

    def save(self):
        """Store the probes of this call in the host cache (merged with what the file holds now)."""
        if self.new:
            path = cache_path()
            store(path, self.key, {**read_cache(path).get(self.key, {}), **self.table})
            self.new = False


def _forward(module: torch.nn.Linear, forms: LinearForms, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if forms.form(module.weight, module.bias, rows) == "mm":
        return mm_linear(x, module.weight, module.bias)
    return F.linear(x, module.weight, module.bias)


@contextlib.contextmanager
def linear_forms(target, forms: LinearForms | None):
    """Within the block, every `torch.nn.Linear` of `target` (exact type, forward not already replaced on the
    instance, e.g. by accelerate's hooks) runs in the form `forms` picks; restored on exit, whatever happens."""
    if forms is None or not forms.active(target):
        yield
        return
    # the instance attribute shadows `nn.Linear.forward` (a plain function); set and removed in the instance dicts
    # directly: `nn.Module.__setattr__`/`__delattr__` would only check it is no parameter, buffer or submodule, at
    # several microseconds a linear, every round
    patches = forms.linears(target)
    for attributes, forward in patches:
        attributes["forward"] = forward
    try:
        yield
    finally:
        for attributes, _ in patches:
            attributes.pop("forward", None)
        forms.save()
