"""Host reads of device tensors, counted on any machine (the GPU readiness of a round, measured on a CPU).

On an accelerator every read of a tensor's values by Python (`.item()`, `.tolist()`, `bool(t)`, an output whose
size depends on the values such as `nonzero` or boolean-mask indexing, an explicit synchronize) waits for every
kernel queued before it: the launch queue drains and the device idles while Python runs. On a CPU these reads cost
nothing, so they go unnoticed; [`HostReadCounter`] counts them where they happen, whatever the device.

    with HostReadCounter() as reads:
        target.generate(**inputs, assistant_model=head)
    reads.total, reads.counts, reads.sites

What is counted (kind: what triggers it):

- `item`, `tolist`, `numpy`: the tensor's values as Python / NumPy data;
- `bool`, `int`, `float`, `index`, `complex`: `bool(t)`, `int(t)`, `float(t)`, `t` as an index or slice bound;
- `compare`: functions returning a Python bool from values (`torch.equal`, `torch.allclose`, `torch.is_nonzero`,
  `x in t`);
- `cpu`: `.cpu()`, or `.to("cpu")` with the device spelled as a string (a `torch.device` taken from a tensor or a
  model is the accelerator on a GPU, so it is not counted: on a CPU run the two cannot be told apart);
- `nonzero`, `mask_index`, `masked_select`, `unique`, `repeat_interleave`: outputs whose size depends on the
  values (`nonzero`/`argwhere`/one-argument `where`, indexing or assigning through a boolean tensor);
- `synchronize`: `torch.accelerator.synchronize`, `torch.cuda.synchronize`, `Event.synchronize`,
  `Event.elapsed_time`, `Stream.synchronize`. With `pretend_accelerator=True` (the default),
  `torch.accelerator.is_available()` reads True inside the counter, so code that syncs only on an accelerator
  shows its syncs on a CPU too (the synchronize calls themselves are then skipped).

Each read is attributed to the innermost frame outside torch and this module (`sites`: `"file:line function"`),
so a breakdown says which line of the round reads.
"""

import collections
import contextlib
import inspect
import os

import torch
from torch.overrides import TorchFunctionMode

_HERE = os.path.abspath(__file__)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep

# torch functions whose result is host data, or whose output size depends on tensor values
_VALUE_READS = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int",
    torch.Tensor.__float__: "float",
    torch.Tensor.__index__: "index",
    torch.Tensor.__complex__: "complex",
    torch.Tensor.__contains__: "compare",
    torch.equal: "compare",
    torch.allclose: "compare",
    torch.Tensor.allclose: "compare",
    torch.Tensor.equal: "compare",
    torch.is_nonzero: "compare",
    torch.Tensor.cpu: "cpu",
    torch.nonzero: "nonzero",
    torch.Tensor.nonzero: "nonzero",
    torch.argwhere: "nonzero",
    torch.Tensor.argwhere: "nonzero",
    torch.masked_select: "masked_select",
    torch.Tensor.masked_select: "masked_select",
    torch.unique: "unique",
    torch.Tensor.unique: "unique",
    torch.unique_consecutive: "unique",
    torch.Tensor.unique_consecutive: "unique",
}


def _is_bool_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.bool


def _masks_by_value(index) -> bool:
    """Whether an indexing key holds a boolean tensor (its selected count is read from the values)."""
    keys = index if isinstance(index, tuple) else (index,)
    return any(_is_bool_tensor(k) or (isinstance(k, list) and any(_is_bool_tensor(x) for x in k)) for k in keys)


def _to_host(args, kwargs) -> bool:
    """Whether a `Tensor.to` call names the CPU as a string."""
    device = kwargs.get("device")
    if device is None and len(args) > 1 and isinstance(args[1], str):
        device = args[1]
    return isinstance(device, str) and device.split(":")[0] == "cpu"


def read_kind(func, args, kwargs) -> str | None:
    """The kind of host read a torch function call makes (see the module docstring), or `None`."""
    kind = _VALUE_READS.get(func)
    if kind is not None:
        return kind
    if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put, torch.Tensor.index_put_):
        return "mask_index" if len(args) > 1 and _masks_by_value(args[1]) else None
    if func is torch.Tensor.to:
        return "cpu" if _to_host(args, kwargs) else None
    if func is torch.where:
        return "nonzero" if len(args) + len(kwargs) == 1 else None
    if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return "repeat_interleave" if isinstance(repeats, torch.Tensor) and "output_size" not in kwargs else None
    return None


def _caller() -> str:
    """`"file:line function"` of the innermost frame outside torch and this module."""
    frame = inspect.currentframe().f_back.f_back  # past this function and its caller in this module
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _HERE and not path.startswith(_TORCH):
            return f"{os.path.relpath(path)}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class HostReadCounter(TorchFunctionMode):
    """A `TorchFunctionMode` that counts host reads of tensor values by kind and by site (module docstring).

    Args:
        pretend_accelerator (`bool`, *optional*, defaults to `True`): `torch.accelerator.is_available()` reads True
            inside the counter and the synchronize calls are counted, then skipped.

    Attributes:
        counts (`collections.Counter`): reads per kind.
        sites (`collections.Counter`): reads per `(kind, "file:line function")`.
    """

    def __init__(self, pretend_accelerator: bool = True):
        super().__init__()
        self.pretend_accelerator = pretend_accelerator
        self.counts, self.sites = collections.Counter(), collections.Counter()
        self._patches = contextlib.ExitStack()
        self._paused = 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def record(self, kind: str):
        if not self._paused:
            self.counts[kind] += 1
            self.sites[(kind, _caller())] += 1

    @contextlib.contextmanager
    def paused(self):
        """Reads inside this block are not counted (a test's own oracle, say)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = read_kind(func, args, kwargs)
        if kind is not None:
            self.record(kind)
        return func(*args, **kwargs)

    def __enter__(self):
        self._patch_synchronize()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.close()

    def _patch_synchronize(self):
        def counted(original):
            def synchronize(*args, **kwargs):
                self.record("synchronize")
                if not self.pretend_accelerator:
                    return original(*args, **kwargs)
                return 0.0

            return synchronize

        targets = [
            (torch.accelerator, "synchronize"),
            (torch.cuda, "synchronize"),
            (torch.cuda.Event, "synchronize"),
            (torch.cuda.Event, "elapsed_time"),
            (torch.cuda.Stream, "synchronize"),
        ]
        for owner, name in targets:
            self._patches.enter_context(_patched(owner, name, counted(getattr(owner, name))))
        if self.pretend_accelerator:
            self._patches.enter_context(_patched(torch.accelerator, "is_available", lambda: True))

    def breakdown(self, per: float = 1.0) -> str:
        """One line per kind, `kind count` divided by `per` (say, the rounds), most frequent first."""
        return ", ".join(f"{kind} {count / per:.2f}" for kind, count in self.counts.most_common())


@contextlib.contextmanager
def _patched(owner, name: str, value):
    original = owner.__dict__[name] if name in owner.__dict__ else getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)
