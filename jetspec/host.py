"""Which dtype the CPU runs fastest, measured rather than read from a flag.

A CPU flag (`avx512_bf16`, `amx_bf16`) says what the hardware can do, not which kernels ATen and oneDNN run:
with `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` the flag stays set while bf16 matmuls fall back to
emulation, 10-25x slower than float32. So the decision takes three things into account:

1. the environment: ATen held below the CPU's AVX-512 (its reported capability is lower than the flags allow, or
   `ATEN_CPU_CAPABILITY` / `ONEDNN_MAX_CPU_ISA` / `DNNL_MAX_CPU_ISA` name AVX2 or less) means float32, unprobed;
2. the flags and ATen's capability, which name the host kind ("AVX2 only", "AVX-512 + bf16", "AVX-512 + AMX");
3. a timed probe: median time of a `(32, 576) x (576, 1536)` linear (a decode step of a 135M model) in bf16 and in
   float32; bfloat16 wins only when it is faster.

The decision is cached per host in a small JSON file (`$JETSPEC_HOST_CACHE`, else `$JETSPEC_CACHE/host.json`, else
`~/.cache/jetspec/host.json`), keyed by the capability, CPU model, flags, torch version and the environment
variables above, so the probe runs once per host and setting.
"""

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

# the host facts and the cache file are shared with the verify's linear forms (`modeling_jetspec/host_cache.py`)
from modeling_jetspec.host_cache import (  # noqa: F401 (re-exported: jetspec.host.cache_path, ...)
    CACHE_ENV,
    FLAGS,
    ISA_ENV,
    cache_path,
    cpu_info,
    host_key,
    read_cache,
    store,
)

PROBE_SHAPE = (32, 576, 1536)  # (rows, in, out) of the probe's linear: one decode step of SmolLM2-135M's MLP
PROBE_SECONDS = 0.1  # per dtype (torch.utils.benchmark's blocked_autorange: the median of blocks of calls)
# ISA names at or below AVX2 that the environment can cap ATen or oneDNN to (oneDNN's names, case-insensitive)
AT_MOST_AVX2 = {"default", "avx2", "avx2_vnni", "avx2_vnni_2", "avx", "sse41"}


@dataclass
class HostKind:
    """What this host runs fast, and why.

    Args:
        name (`str`): short human name of the host kind, e.g. `"AVX-512 + AMX"` or
            `"AVX-512 + AMX (ATen forced to AVX2)"`; results files record it.
        dtype (`str`): `"bfloat16"` or `"float32"`, the dtype `--dtype auto` and training pick on this host.
        reason (`str`): why, in one line.
        capability (`str`): `torch.backends.cpu.get_cpu_capability()`.
        bf16_ms (`float`, *optional*): probe time of the bf16 linear, milliseconds (None when not probed).
        fp32_ms (`float`, *optional*): probe time of the float32 linear, milliseconds (None when not probed).
    """

    name: str
    dtype: str
    reason: str
    capability: str
    bf16_ms: Optional[float] = None
    fp32_ms: Optional[float] = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.dtype == "bfloat16" else torch.float32


def forced_below_avx512(capability: str, flags: frozenset, env: dict) -> bool:
    """True when the environment holds ATen or oneDNN at AVX2 or below on a CPU whose flags allow AVX-512."""
    capped = any(env.get(name, "").strip().lower() in AT_MOST_AVX2 for name in ISA_ENV)
    return capped or ("avx512f" in flags and not capability.upper().startswith("AVX512"))


def kind_name(capability: str, flags: frozenset, forced: bool) -> str:
    """The host kind: the hardware (from the flags, else ATen's capability) plus "(ATen forced to AVX2)"."""
    if "amx_bf16" in flags:
        name = "AVX-512 + AMX"
    elif "avx512_bf16" in flags:
        name = "AVX-512 + bf16"
    elif "avx512f" in flags or capability.upper().startswith("AVX512"):
        name = "AVX-512"
    elif "avx2" in flags or capability.upper() == "AVX2":
        name = "AVX2 only"
    else:
        name = capability
    return f"{name} (ATen forced to AVX2)" if forced else name


def probe_matmul(seconds: float = PROBE_SECONDS) -> tuple[float, float]:
    """Median milliseconds of one `(32, 576) x (576, 1536)` linear in bfloat16 and in float32, this process's threads.

    Returns:
        `(bf16_ms, fp32_ms)`.
    """
    from torch.utils.benchmark import Timer

    rows, d_in, d_out = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, d_in, generator=generator)
    w = torch.randn(d_out, d_in, generator=generator) / d_in**0.5
    times = []
    for dtype in (torch.bfloat16, torch.float32):
        xs, ws = x.to(dtype), w.to(dtype)
        for _ in range(3):  # oneDNN builds its primitive on the first call
            torch.nn.functional.linear(xs, ws)
        timer = Timer("linear(x, w)", globals={"linear": torch.nn.functional.linear, "x": xs, "w": ws})
        times.append(timer.blocked_autorange(min_run_time=seconds).median * 1e3)
    return times[0], times[1]


def decide(capability: str, flags: frozenset, env: dict, probe: Callable[[], tuple[float, float]]) -> HostKind:
    """The host kind and its dtype (pure but for `probe`, which is called only when the environment allows bf16).

    Args:
        capability (`str`): ATen's CPU capability, e.g. `"AVX512"`, `"AVX2"`.
        flags (`frozenset` of `str`): CPU flags among [`FLAGS`].
        env (`dict`): the environment (only [`ISA_ENV`] is read).
        probe (`Callable[[], tuple[float, float]]`): returns `(bf16_ms, fp32_ms)`, see [`probe_matmul`].
    """
    forced = forced_below_avx512(capability, flags, env)
    name = kind_name(capability, flags, forced)
    if forced:
        settings = ", ".join(f"{k}={env[k]}" for k in ISA_ENV if env.get(k)) or f"ATen capability {capability}"
        return HostKind(
            name,
            "float32",
            f"auto: ATen or oneDNN held at AVX2 or below ({settings}), whatever the CPU flags say",
            capability,
        )
    bf16_ms, fp32_ms = probe()
    ratio = f"bf16 {bf16_ms:.3f} ms vs fp32 {fp32_ms:.3f} ms per (32x576)x(576x1536) linear"
    if bf16_ms < fp32_ms:
        return HostKind(name, "bfloat16", f"auto: bf16 measured faster ({ratio})", capability, bf16_ms, fp32_ms)
    return HostKind(name, "float32", f"auto: bf16 measured slower ({ratio})", capability, bf16_ms, fp32_ms)


def host_kind(path: Optional[os.PathLike] = None, probe: Callable[[], tuple[float, float]] = probe_matmul) -> HostKind:
    """This host's kind and the dtype it runs fastest, from the cache in `path` (see [`cache_path`]) or measured and
    stored there.

    Args:
        path (`os.PathLike`, *optional*): the cache file; defaults to [`cache_path`]`()`.
        probe (`Callable`, *optional*, defaults to [`probe_matmul`]): the timed probe, for a cache miss.

    Returns:
        [`HostKind`].
    """
    path = Path(path) if path is not None else cache_path()
    capability = torch.backends.cpu.get_cpu_capability()
    model, flags = cpu_info()
    env = {k: os.environ[k] for k in ISA_ENV if k in os.environ}
    key = host_key(capability, model, flags, env)
    cached = read_cache(path)
    if key in cached:
        return HostKind(**cached[key])
    kind = decide(capability, flags, env, probe)
    store(path, key, asdict(kind))  # atomic, keeping the file's other keys (the verify's linear forms)
    return kind
