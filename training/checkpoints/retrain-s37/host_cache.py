"""Facts about this host that decoding decisions are cached under, and the cache file they live in.

Shared by `jetspec/host.py` (which dtype the CPU runs fastest) and [`linear_forms`] (which form of a linear the
verify runs fastest): one JSON object per host file (`$JETSPEC_HOST_CACHE`, else `$JETSPEC_CACHE/host.json`, else
`~/.cache/jetspec/host.json`), keyed by [`host_key`]: ATen's capability, the CPU model and flags, the torch version
and the environment variables that cap the ISA. Lives in `modeling_jetspec` so a head loaded as remote code reads
the same facts without the `jetspec` package.
"""

import json
import os
import platform
import tempfile
from pathlib import Path

import torch

CACHE_ENV = "JETSPEC_HOST_CACHE"
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # the /proc/cpuinfo flags the kind is named from


def cpu_info(path: str = "/proc/cpuinfo") -> tuple[str, frozenset]:
    """`(model name, flags)` of the first CPU in `path`, flags restricted to [`FLAGS`]; `(platform.processor(),
    empty)` where the file does not exist (not Linux)."""
    if not os.path.isfile(path):
        return platform.processor(), frozenset()
    model, flags = "", frozenset()
    with open(path) as f:
        for line in f:
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key == "flags":
                flags = frozenset(value.split()) & frozenset(FLAGS)
                break
    return model, flags


def cache_path() -> Path:
    """`$JETSPEC_HOST_CACHE`, else `$JETSPEC_CACHE/host.json`, else `~/.cache/jetspec/host.json`."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("JETSPEC_CACHE", "~/.cache/jetspec")).expanduser() / "host.json"


def host_key(capability: str, model: str, flags: frozenset, env: dict) -> str:
    """The cache key: everything a host decision depends on that can change between runs on one host."""
    settings = ",".join(f"{k}={env.get(k, '')}" for k in ISA_ENV)
    return f"{capability}|{model}|{','.join(sorted(flags))}|torch {torch.__version__}|{settings}"


def this_host_key() -> str:
    """[`host_key`] of this process: ATen's capability, [`cpu_info`] and the ISA variables of the environment."""
    model, flags = cpu_info()
    env = {k: os.environ[k] for k in ISA_ENV if k in os.environ}
    return host_key(torch.backends.cpu.get_cpu_capability(), model, flags, env)


def read_cache(path: Path) -> dict:
    """The cache file's object (`{}` when there is no file); a `ValueError` when it holds something else."""
    cached = json.loads(path.read_text()) if path.is_file() else {}
    if not isinstance(cached, dict):
        raise ValueError(f"expected a JSON object of host keys in {path}, got {type(cached).__name__}")
    return cached


def store(path: Path, key: str, value) -> None:
    """Set `key` to `value` in the cache file, keeping every other key; written atomically (a concurrent reader sees
    the old file or the new one)."""
    cached = read_cache(path)
    cached[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        f.write(json.dumps(cached, indent=1) + "\n")
    os.replace(f.name, path)
