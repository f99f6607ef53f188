"""The host's dtype decision (jetspec.host): measured by a probe, never trusted from a CPU flag alone.

The probe is replaced by a stub returning `(bf16_ms, fp32_ms)`; nothing here is timed."""

import json

import pytest
import torch

from jetspec import host
from jetspec.host import HostKind, decide, forced_below_avx512, host_kind, kind_name
from jetspec.targets import resolve_dtype

AMX = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
AVX2 = frozenset({"avx2"})
FORCED = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def probe_returning(bf16_ms: float, fp32_ms: float):
    calls = []

    def probe():
        calls.append(1)
        return bf16_ms, fp32_ms

    return probe, calls


def test_fast_bf16_picks_bf16():
    probe, calls = probe_returning(0.14, 0.80)
    kind = decide("AVX512", AMX, {}, probe)
    assert (kind.name, kind.dtype, kind.torch_dtype, len(calls)) == ("AVX-512 + AMX", "bfloat16", torch.bfloat16, 1)
    assert "faster" in kind.reason and kind.bf16_ms == 0.14


def test_slow_bf16_picks_float32_whatever_the_flags():
    # (a) flags claim native bf16 but the measurement disagrees: the measurement wins
    probe, _ = probe_returning(3.1, 0.62)
    kind = decide("AVX512", AMX, {}, probe)
    assert (kind.name, kind.dtype) == ("AVX-512 + AMX", "float32") and "slower" in kind.reason
    # (b) an AVX2-only CPU, probed like any other
    probe, _ = probe_returning(3.1, 0.62)
    assert decide("AVX2", AVX2, {}, probe).name == "AVX2 only"


@pytest.mark.parametrize(
    "capability, env",
    [
        ("AVX2", FORCED),  # (a) both forced (ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA): ATen then reports AVX2
        ("AVX512", {"ONEDNN_MAX_CPU_ISA": "avx2"}),  # (b) only oneDNN capped: ATen still reports AVX512
        ("AVX2", {}),  # (c) no variable we know, but ATen reports less than the flags allow
    ],
)
def test_forced_avx2_picks_float32_without_probing(capability, env):
    # the amx/avx512_bf16 flags are not trusted and the probe does not run, even one that would say bf16 is fast
    probe, calls = probe_returning(0.01, 1.0)
    kind = decide(capability, AMX, env, probe)
    assert kind.dtype == "float32" and calls == []
    assert kind.name == "AVX-512 + AMX (ATen forced to AVX2)"


def test_forced_detection():
    assert forced_below_avx512("AVX512", AMX, {"ATEN_CPU_CAPABILITY": "default"})
    assert forced_below_avx512("AVX2", AMX, {})  # ATen below what the flags allow
    assert not forced_below_avx512("AVX2", AVX2, {})  # an AVX2-only CPU is not forced, it is what it is
    assert not forced_below_avx512("AVX512", AMX, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"})


def test_kind_names():
    assert kind_name("AVX512", frozenset({"avx2", "avx512f", "avx512_bf16"}), False) == "AVX-512 + bf16"
    assert kind_name("AVX512", frozenset({"avx2", "avx512f"}), False) == "AVX-512"
    assert kind_name("DEFAULT", frozenset(), False) == "DEFAULT"  # no flags known (not Linux, not x86)


def test_cache_miss_then_hit(tmp_path, monkeypatch):
    monkeypatch.setattr(host, "cpu_info", lambda: ("Test CPU", AMX))
    monkeypatch.setattr(host.torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    for name in host.ISA_ENV:
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "host.json"
    probe, calls = probe_returning(0.1, 0.5)
    first = host_kind(path, probe)
    assert first.dtype == "bfloat16" and len(calls) == 1
    stored = json.loads(path.read_text())
    assert len(stored) == 1 and "Test CPU" in next(iter(stored))
    # a hit: the stored decision comes back, the probe does not run again
    assert host_kind(path, probe) == first and len(calls) == 1
    # another setting of the environment is another key: a miss, decided (here without probing) and added
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    forced = host_kind(path, probe)
    assert forced.dtype == "float32" and len(calls) == 1 and len(json.loads(path.read_text())) == 2


def test_cache_path_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("JETSPEC_HOST_CACHE", str(tmp_path / "elsewhere.json"))
    assert host.cache_path() == tmp_path / "elsewhere.json"
    monkeypatch.delenv("JETSPEC_HOST_CACHE")
    monkeypatch.setenv("JETSPEC_CACHE", str(tmp_path / "root"))
    assert host.cache_path() == tmp_path / "root" / "host.json"
    # host_kind reads and writes the file the env names
    monkeypatch.setenv("JETSPEC_HOST_CACHE", str(tmp_path / "elsewhere.json"))
    host_kind(probe=probe_returning(0.1, 0.5)[0])
    assert (tmp_path / "elsewhere.json").is_file()


def test_resolve_dtype_auto_follows_the_host(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("jetspec.targets.host_kind", lambda: HostKind("AVX2 only", "float32", "auto: slower", "AVX2"))
    assert resolve_dtype("auto") == (torch.float32, "auto: slower; host kind AVX2 only")
    monkeypatch.setattr(
        "jetspec.targets.host_kind", lambda: HostKind("AVX-512 + AMX", "bfloat16", "auto: faster", "AVX512", 0.1, 0.5)
    )
    assert resolve_dtype("auto")[0] == torch.bfloat16
    assert resolve_dtype("float32") == (torch.float32, "requested")


def test_corrupt_cache_raises(tmp_path):
    path = tmp_path / "host.json"
    path.write_text("[]")
    with pytest.raises(ValueError, match="expected a JSON object of host keys"):
        host_kind(path, probe_returning(0.1, 0.5)[0])


def test_training_target_dtype_accepts_auto():
    from training.run_trainer import HeadArguments

    assert HeadArguments(target_dtype="auto").target_dtype == "auto"  # resolved by resolve_dtype when the run starts
    with pytest.raises(ValueError, match=r"expected target_dtype 'auto', 'float32' or 'bfloat16', got 'half'"):
        HeadArguments(target_dtype="half")
