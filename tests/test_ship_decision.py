"""scripts/ship_decision.py and the release step it calls (`training.shipping.replace_head`): a new head ships only
when offline tau and the float32 bench both put it ahead, on results that measured the folders' current weights; its
map is kept only when it raises offline tau; --apply leaves the shipped folder holding the new head alone, loadable."""

import copy
import json

import pytest
import torch

from jetspec.bench import BenchConfig, portable_name, run_benchmark
from jetspec.provenance import weights_identity
from jetspec.report import every_prompt
from modeling_jetspec import JetSpecDraftModel
from modeling_jetspec.calibration import BINS
from test_bench import char_tokenizer
from test_scripts import load_script
from training.shipping import SHIPPED_FILES
from jetspec.tiny import tiny_head, tiny_target

MAP = {"1:head": [0.5] * BINS}  # a calibration map of the config's form (one depth and source)


def bench_results(folder, new, shipped, target, suites=("gsm8k", "mtbench")) -> dict:
    """A float32 bench of both heads side by side, by `jetspec.bench` itself: the layout `ship_decision` reads is the
    one the bench writes (a hand-made copy once drifted from it: the heads' identities live under `config`)."""
    config = BenchConfig(list(suites), [8], 4, limit=1, methods=("plain", "lookup"), warmup=False, cost_repeats=1)
    head, baseline = (JetSpecDraftModel.from_pretrained(path) for path in (new, shipped))
    return run_benchmark(target, char_tokenizer(), head, config, folder, progress=False, baseline_head=baseline)


def write_results(out, new, shipped, bench_run, offline=(3.2, 3.1), calibrated=None, bench=(2.6, 2.5), mismatch=0):
    """The campaign's results folder: offline figures as given, the real bench's results with its taus set to `bench`
    (and `mismatch` outputs of the new head's method turned into mismatches)."""
    out.mkdir(parents=True, exist_ok=True)
    ids = {h: weights_identity(h) for h in (new, shipped)}
    heads = {new: {"8": {"tau": offline[0]}}, shipped: {"8": {"tau": offline[1]}}}
    (out / "offline-defaults.json").write_text(json.dumps({"rows": 100, "heads": heads, "head_identity": ids}))
    if calibrated is not None:
        cal = {"heads": {new: {"8": {"tau": calibrated}}}, "head_identity": {new: ids[new]}}
        (out / "offline-calibrated.json").write_text(json.dumps(cal))
        (out / "calibration-map.json").write_text(json.dumps(MAP))
    results = copy.deepcopy(bench_run)
    everything = every_prompt(results["aggregates"])
    for name, tau in zip(("tree-8-lookup", "tree-8-lookup@baseline"), bench):
        everything[name]["tau_mean"] = tau
    equality = everything["tree-8-lookup"]["equality"]
    equality["exact"] -= mismatch
    equality["mismatch"] += mismatch
    (out / "bench-fp32").mkdir(exist_ok=True)
    (out / "bench-fp32" / "results.json").write_text(json.dumps(results))


@pytest.fixture
def heads(tmp_path):
    target = tiny_target()
    new, shipped = tmp_path / "new", tmp_path / "shipped"
    tiny_head(target, seed=1).save_pretrained(new)
    tiny_head(target, seed=2).save_pretrained(shipped)
    (new / "metrics.json").write_text("{}")
    (new / "trainer_state.json").write_text("{}")  # a kept head's resume state: not shipped
    (shipped / "training_config.yaml").write_text("old: head\n")  # the old head's file: removed on shipping
    new, shipped = str(new), str(shipped)
    return new, shipped, bench_results(tmp_path / "bench", new, shipped, target), target


def test_the_new_head_ships_only_when_both_judgements_put_it_ahead(tmp_path, heads):
    ship = load_script("ship_decision")
    new, shipped, bench_run, target = heads
    for offline, bench, ships in (
        ((3.2, 3.1), (2.6, 2.5), True),
        ((3.0, 3.1), (2.6, 2.5), False),
        ((3.2, 3.1), (2.4, 2.5), False),
    ):
        out = tmp_path / f"r{offline[0]}{bench[0]}"
        write_results(out, new, shipped, bench_run, offline, bench=bench)
        decision = ship.main(["--results", str(out), "--new", new, "--shipped", shipped])
        assert decision["ships"] is ships and decision["offline_tau"] == {"new": offline[0], "shipped": offline[1]}
        assert decision["bench_fp32"]["new"]["tau"] == bench[0] and decision["keep_calibration"] is False
        assert json.loads((out / "decision.json").read_text())["ships"] is ships
    # a bench of one suite has no `all` group: that suite is every prompt
    one_suite = bench_results(tmp_path / "bench-one", new, shipped, target, suites=("gsm8k",))
    assert "all" not in one_suite["aggregates"]
    write_results(out := tmp_path / "one-suite", new, shipped, one_suite)
    assert ship.main(["--results", str(out), "--new", new, "--shipped", shipped])["bench_fp32"]["new"]["tau"] == 2.6
    out = tmp_path / "mismatch"
    write_results(out, new, shipped, bench_run, mismatch=1)
    with pytest.raises(ValueError, match="equal to plain greedy"):
        ship.main(["--results", str(out), "--new", new, "--shipped", shipped])
    with pytest.raises(ValueError, match="offline-defaults.json"):
        ship.main(["--results", str(tmp_path / "empty"), "--new", new, "--shipped", shipped])


@pytest.mark.parametrize("calibrated, kept", [(3.3, True), (3.1, False)])
def test_apply_replaces_the_shipped_head_with_the_map_only_where_it_raises_tau(tmp_path, heads, calibrated, kept):
    ship = load_script("ship_decision")
    new, shipped, bench_run, _ = heads
    out = tmp_path / "results"
    write_results(out, new, shipped, bench_run, calibrated=calibrated)  # offline tau without the map: 3.2
    decision = ship.main(["--results", str(out), "--new", new, "--shipped", shipped, "--apply"])
    assert decision["ships"] and decision["keep_calibration"] is kept
    expected = [name for name in SHIPPED_FILES if (tmp_path / "new" / name).is_file()]
    assert "model.safetensors" in expected and "trainer_state.json" not in expected
    assert sorted(p.name for p in (tmp_path / "shipped").iterdir()) == sorted(expected)  # the old head's files gone
    config = json.loads((tmp_path / "shipped" / "config.json").read_text())
    assert config.get("tree_calibration") == (MAP if kept else None) and "auto_map" not in config
    loaded = JetSpecDraftModel.from_pretrained(shipped)
    for a, b in zip(loaded.state_dict().values(), JetSpecDraftModel.from_pretrained(new).state_dict().values()):
        assert torch.equal(a, b)
    # the shipped folder now holds other weights than the results measured: deciding again is refused
    with pytest.raises(ValueError, match="no longer"):
        ship.main(["--results", str(out), "--new", new, "--shipped", shipped])


@pytest.mark.parametrize("calibrated, kept", [(3.3, True), (3.1, False)])
def test_candidate_is_the_new_head_as_it_would_ship_from_the_offline_results_alone(tmp_path, heads, calibrated, kept):
    """Before the float32 bench: the new head's weights with its map where offline tau keeps it, so the bench races
    it against the shipped head's own map; the decision then names the folders the bench loaded."""
    ship = load_script("ship_decision")
    new, shipped, bench_run, target = heads
    out = tmp_path / "results"
    write_results(out, new, shipped, bench_run, calibrated=calibrated)
    (out / "bench-fp32" / "results.json").unlink()  # the bench runs after the candidate is written
    candidate = tmp_path / "candidate"
    staged = ship.main(["--results", str(out), "--new", new, "--shipped", shipped, "--candidate", str(candidate)])
    assert staged["keep_calibration"] is kept and "ships" not in staged
    assert json.loads((candidate / "config.json").read_text()).get("tree_calibration") == (MAP if kept else None)
    loaded = JetSpecDraftModel.from_pretrained(candidate)
    for a, b in zip(loaded.state_dict().values(), JetSpecDraftModel.from_pretrained(new).state_dict().values()):
        assert torch.equal(a, b)
    assert weights_identity(candidate)["weights_sha256"] == weights_identity(new)["weights_sha256"]
    # the bench of the candidate against the shipped head counts as the new head's
    write_results(
        out, new, shipped, bench_results(tmp_path / "bench2", str(candidate), shipped, target), calibrated=calibrated
    )
    decision = ship.main(["--results", str(out), "--new", new, "--shipped", shipped])
    assert decision["ships"] and decision["bench_fp32_folders"] == {
        "new": {"folder": portable_name(str(candidate)), "calibration_map": kept},
        "shipped": {"folder": portable_name(shipped), "calibration_map": False},
    }
    with pytest.raises(ValueError, match="empty folder"):  # never over an earlier candidate: the script clears it
        ship.main(["--results", str(out), "--new", new, "--shipped", shipped, "--candidate", str(candidate)])
    with pytest.raises(ValueError, match="got both"):
        ship.main(["--results", str(out), "--new", new, "--shipped", shipped, "--candidate", "x", "--apply"])
