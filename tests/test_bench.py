"""The benchmark (`jetspec.bench`, `jetspec.report`) on tiny random targets with an in-process character tokenizer.

Its headline guarantee is checked from outside: every `generate` call it makes is recorded, and on every prompt
each method's tokens must equal plain greedy's, and each row's statistics must be those its own call returned.
Bracketing it, a method that returns a wrong token must fail the run. The aggregates are checked on constructed
rows whose medians, quartiles and means are known in advance.
"""

import json
import os

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jetspec.bench import (
    REPO_ROOT,
    BenchConfig,
    Method,
    PromptRow,
    aggregate,
    aggregate_groups,
    phase_figures,
    portable_name,
    run_benchmark,
)
from jetspec.bench_figures import phase_lines
from jetspec.report import summary_table
from jetspec.equality import LosslessError, Verdict
from jetspec.prompts import SUITES
from modeling_jetspec import JetSpecDraftModel, JetSpecStats
from modeling_jetspec.configuration_jetspec import TREE_FIELDS
from jetspec.tiny import tiny_head, tiny_target
from modeling_jetspec.round_hook import PHASES

SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BUDGETS = [4, 12]
MAX_NEW = 10
METHODS = [
    "plain",
    "prompt_lookup",
    "chain",
    "tree-4",
    "tree-12",
    "auto",
    "tree-12-pc",
    "tree-4-lookup",
    "tree-12-lookup",
    "tree-4-lookup-first",
    "tree-12-lookup-first",
    "tree-4-gap",
    "tree-12-gap",
    "tree-4-lookup-gap",
    "tree-12-lookup-gap",
]


def char_tokenizer(specials=tuple(SPECIALS), template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """One token per printable ASCII character or newline (ids < 100), anything else is `<unk>`; `specials` first
    (pad, unk, then the chat markers), `template` its chat template."""
    specials = list(specials)
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        additional_special_tokens=specials[2:],
    )
    tokenizer.chat_template = template
    return tokenizer


def tiny_pair():
    # suite prompts run to ~1,400 characters (one token each): room for them plus the answer
    target = tiny_target("llama", max_position_embeddings=4096)
    # a default prompt-lookup branch, as the shipped head has: the head-only methods must switch it off
    # and a chain (6) longer than the head's depth (4): the lookup methods take the head's chain length
    return target, tiny_head(
        target,
        tree_depth=4,
        tree_width=3,
        tree_budget=12,
        tree_lookup=6,
        tree_lookup_prior=[[0.2, 0.1], [0.5, 0.3], [0.9, 0.8]],
    )


def spy_generate(monkeypatch, target):
    """Record every outer `target.generate` call: prompt ids (a tuple), tree/lookup arguments, head or not, the
    answer cache it was given with what that cache held as the call started, new tokens, and the `jetspec_stats`
    its output carried."""
    calls = []
    original = target.generate

    def generate(*args, **kwargs):
        cache = kwargs.get("jetspec_answer_cache")
        held = cache.answers() if cache is not None else None
        out = original(*args, **kwargs)
        if "custom_generate" not in kwargs:  # the tree loop re-enters generate with a callable: not an outer call
            ids = kwargs["input_ids"]
            key = {k: kwargs[k] for k in ("prompt_lookup_num_tokens", *TREE_FIELDS) if k in kwargs}
            calls.append(
                {
                    "prompt": tuple(ids[0].tolist()),
                    "key": key,
                    "assisted": "assistant_model" in kwargs,
                    "cache": cache,
                    "held": held,
                    "tokens": out.sequences[0, ids.shape[1] :].tolist(),
                    "stats": getattr(out, "jetspec_stats", None),
                }
            )
        return out

    monkeypatch.setattr(target, "generate", generate)
    return calls


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One benchmark run over every suite and method (2 prompts each), with its generate calls recorded."""
    monkeypatch = pytest.MonkeyPatch()
    target, head = tiny_pair()
    calls = spy_generate(monkeypatch, target)
    out = tmp_path_factory.mktemp("bench")
    config = BenchConfig(list(SUITES), BUDGETS, MAX_NEW, limit=2, cost_repeats=2)
    results = run_benchmark(target, char_tokenizer(), head, config, out, command="pytest", progress=False)
    monkeypatch.undo()
    return results, calls, out


def measured_calls(calls) -> list[list[dict]]:
    """The timed calls (warm-up ones run 8 tokens), one list of `len(METHODS)` per prompt, in the bench's order."""
    timed = [c for c in calls if len(c["tokens"]) == MAX_NEW]
    return [timed[i : i + len(METHODS)] for i in range(0, len(timed), len(METHODS))]


def test_every_method_reproduces_plain_greedy(run):
    results, calls, _ = run
    prompts = measured_calls(calls)
    assert len(prompts) == 2 * len(SUITES)  # every prompt reached every method
    for group in prompts:
        assert len({c["prompt"] for c in group}) == 1
        plain = [c["tokens"] for c in group if not c["assisted"] and not c["key"]]
        assert len(plain) == 1
        for call in group:
            assert call["tokens"] == plain[0], call["key"]
    assert all(r["equality"] == "exact" for r in results["prompts"])  # float32: bitwise
    assert [r["method"] for r in results["prompts"]] == METHODS * 2 * len(SUITES)


def test_methods_pass_their_arguments(run):
    results, calls, _ = run
    arguments = results["config"]["method_arguments"]
    assert arguments["tree-12-pc"] == {"tree_budget": 12, "path_conditioning": True, "tree_lookup": 0}
    assert arguments["tree-4-lookup"] == {"tree_budget": 4, "tree_lookup": 6}  # the head's prior scores the chain
    assert arguments["tree-4-lookup-first"] == {"tree_budget": 4, "tree_lookup": 6, "tree_lookup_prior": False}
    assert arguments["chain"] == {"tree_depth": 4, "tree_width": 1, "tree_budget": 4, "tree_lookup": 0}
    assert arguments["tree-12-gap"] == {"tree_budget": 12, "tree_lookup": 0, "tree_scoring": "gap"}
    assert arguments["tree-4-lookup-gap"] == {"tree_budget": 4, "tree_lookup": 6, "tree_scoring": "gap"}
    # chain, tree-B, tree-B-pc and tree-B-gap measure the head alone although the head's default has a lookup branch
    for name in ("chain", "tree-4", "tree-12", "tree-12-pc", "tree-4-gap"):
        assert arguments[name]["tree_lookup"] == 0, name
    assert arguments["auto"] == {"tree_budget": "auto"}  # the operating point chooses its sources too
    for group in measured_calls(calls):  # and these arguments are the ones generate received
        sent = sorted(json.dumps(c["key"], sort_keys=True) for c in group)
        assert sent == sorted(json.dumps(arguments[m], sort_keys=True) for m in METHODS)


def test_head_statistics_are_each_calls_own(run):
    """Each head row holds the `jetspec_stats` of its own generate call (not another call's, not a side channel)."""
    results, calls, _ = run
    rows = results["prompts"]
    for i, group in enumerate(measured_calls(calls)):
        mine = rows[i * len(METHODS) : (i + 1) * len(METHODS)]
        by_arguments = {json.dumps(c["key"], sort_keys=True): c["stats"] for c in group}
        for row in mine:
            stats = by_arguments[json.dumps(results["config"]["method_arguments"][row["method"]], sort_keys=True)]
            if stats is None:
                assert "tau" not in row and "acceptance_per_depth" not in row, row["method"]  # no None-filled keys
                continue
            assert (row["tau"], row["target_forwards"], row["rounds"]) == (
                stats.tau,
                stats.target_forwards,
                stats.rounds,
            )
            assert row["acceptance_per_depth"] == stats.acceptance_per_depth
            # batch 1: the prefill commits one token, each verify forward commits tau on average
            assert row["tau"] == pytest.approx((MAX_NEW - 1) / (row["target_forwards"] - 1))


def test_head_rows_time_their_rounds_phases_through_the_hook(run):
    """Each head row's phase seconds come from its own call's round hook: their verify phase is the call's
    statistics' verify seconds, the rest its outside-verify seconds (both filled by the same timed rounds); each head
    method's shares cover its rounds' time, and the time outside its two forwards is put against t(1)."""
    results, _, out = run
    for row in results["prompts"]:
        if "tau" not in row:
            assert "phase_seconds" not in row, row["method"]  # plain and prompt lookup run no rounds of ours
            continue
        phases = row["phase_seconds"]
        assert tuple(phases) == PHASES and all(seconds >= 0.0 for seconds in phases.values())
        assert phases["verify"] == pytest.approx(row["verify_seconds"])
        assert sum(phases.values()) - phases["verify"] == pytest.approx(row["outside_verify_seconds"])
    step = results["costs"]["target_step_seconds"]
    for name, figures in results["aggregates"]["all"].items():
        if figures.get("tau_mean") is None:
            assert "phase_shares" not in figures, name
            continue
        assert tuple(figures["phase_shares"]) == PHASES
        assert sum(figures["phase_shares"].values()) == pytest.approx(1.0)
        outside = figures["outside_forwards_seconds_per_round"]
        assert figures["outside_forwards_per_target_step"] == pytest.approx(outside / step)
    report = (out / "results.md").read_text()
    table = report.split("## Round phases")[1]
    assert all(f"| {name} |" in table for name in METHODS if name not in ("plain", "prompt_lookup"))


def test_phase_figures_of_known_rows():
    """Two calls of 2 rounds each with known phase seconds: shares over the summed time, the time outside the draft
    and verify phases per round, and that time over a known t(1)."""
    stats = JetSpecStats(rounds=2, row_rounds=2, round_tokens=4, accepted_at_depth=[1])
    first = dict(draft=1.0, tree=0.5, verify=5.0, accept=0.25, commit=0.25, compact=1.0)
    second = dict(draft=1.0, tree=1.5, verify=5.0, accept=0.25, commit=0.25, compact=0.0)
    rows = [make_row("tree-4", 1.0, 1.0, stats=stats, phases=p) for p in (first, second)]
    figures = phase_figures(rows, {"target_step_seconds": 0.5})
    # 16 s in all: draft 2, tree 2, verify 10, accept 0.5, commit 0.5, compact 1; outside the forwards 4 s / 4 rounds
    assert figures["phase_shares"] == {
        "draft": 0.125,
        "tree": 0.125,
        "verify": 0.625,
        "accept": 0.03125,
        "commit": 0.03125,
        "compact": 0.0625,
    }
    assert figures["outside_forwards_seconds_per_round"] == 1.0
    assert figures["outside_forwards_per_target_step"] == 2.0
    assert phase_figures(rows, None)["outside_forwards_per_target_step"] is None
    untimed = phase_figures([make_row("tree-4", 1.0, 1.0, stats=stats)], None)
    assert untimed == dict.fromkeys(untimed) and len(untimed) == 3  # nothing timed: no figures, not zeros
    method = Method("tree-4", "tree", uses_head=True, budget=4)
    lines = phase_lines({"gsm8k": {"tree-4": aggregate(rows, method, {"target_step_seconds": 0.5, "verify": {}})}})
    assert lines[-1] == "| tree-4 | 12.5% | 12.5% | 62.5% | 3.1% | 3.1% | 6.2% | 2.000 | 1000.00 |"


def test_costs_time_the_trees_the_methods_verify(run):
    costs = run[0]["costs"]
    assert set(costs["verify"]) == {"4", "12"}
    assert [costs["verify"][b]["nodes"] for b in ("4", "12")] == BUDGETS  # depth 4, width 3 holds 120 nodes
    assert costs["chain"]["nodes"] == 4


def test_results_json_is_the_returned_results_without_absolute_paths(run):
    results, _, out = run
    text = (out / "results.json").read_text()
    assert json.loads(text) == json.loads(json.dumps(results))
    assert results["command"] == "pytest" and results["config"]["max_new_tokens"] == MAX_NEW
    assert str(out) not in text and str(REPO_ROOT) not in text
    assert not [s for s in strings(json.loads(text)) if os.path.isabs(s)]
    assert set(results["aggregates"]) == set(SUITES) | {"all"}
    assert list(results["aggregates"]["all"]) == METHODS


def strings(value):
    """Every string inside nested dicts and lists."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        for item in value:
            yield from strings(item)
    elif isinstance(value, str):
        yield value


def test_portable_names(tmp_path):
    assert portable_name(str(REPO_ROOT / "jetspec" / "heads" / "smollm2-135m")) == "jetspec/heads/smollm2-135m"
    assert portable_name(str(tmp_path / "my-head")) == "my-head"  # outside the repository: the folder's own name
    assert portable_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert portable_name("") is None


def test_report_names_every_method_of_every_suite(run):
    results, _, out = run
    report = (out / "results.md").read_text()
    sections = report.split("\n## ")
    for group in (*SUITES, "all"):
        (section,) = [s for s in sections if s.startswith(group + "\n")]
        names = [line.split("|")[1].strip() for line in section.splitlines()[4:] if line.startswith("| ")]
        assert names == METHODS, group
    costs = [s for s in sections if s.startswith("Costs\n")][0]
    assert [
        line.split("|")[1].strip()
        for line in costs.splitlines()
        if line.startswith("| tree-") or line.startswith("| chain")
    ] == ["tree-4", "tree-12", "chain"]
    assert sorted(results["plots"]) == ["acceptance_per_depth.png", "speedup_vs_budget.png"]
    for name in results["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"![{name}]({name})" in report


# ------------------------------------------------------------------------------------------------ aggregates
def make_row(
    method: str, seconds: float, speedup: float, kind: str = "exact", suite: str = "gsm8k", stats=None, phases=None
):
    verdict = Verdict(kind) if kind == "exact" else Verdict(kind, 3, 7, 8, 0.1)
    return PromptRow(suite, f"p{seconds}", method, 20, 10, seconds, speedup, 0, verdict, stats, phases)


def test_aggregate_of_known_rows():
    """Five prompts whose speedups, tokens/s and verdicts have known medians, quartiles and counts."""
    speedups = [3.0, 0.5, 2.0, 1.0, 1.5]  # sorted 0.5, 1, 1.5, 2, 3: q25 1.0, median 1.5, q75 2.0 (linear)
    seconds = [1.0, 2.0, 4.0, 5.0, 10.0]  # 10 tokens each: 10, 5, 2.5, 2, 1 tokens/s, median 2.5
    kinds = ["exact", "tie", "exact", "tie", "exact"]
    rows = [make_row("prompt_lookup", s, x, k) for s, x, k in zip(seconds, speedups, kinds)]
    figures = aggregate(rows, Method("prompt_lookup", "prompt_lookup"), costs=None)
    assert (figures["speedup_q25"], figures["speedup_median"], figures["speedup_q75"]) == (1.0, 1.5, 2.0)
    assert (figures["speedup_min"], figures["speedup_max"]) == (0.5, 3.0)
    assert figures["tokens_per_s_median"] == 2.5
    assert figures["equality"] == {"exact": 3, "tie": 2, "mismatch": 0}
    assert (figures["prompts"], figures["new_tokens"], figures["seconds"]) == (5, 50, 22.0)
    assert "tau_mean" not in figures  # no head, no head figures


def test_aggregate_of_head_rows_with_known_statistics():
    """Two prompts: tau 2 and 3, acceptance over 4 rounds each, one tree shallower than the other."""
    shallow = JetSpecStats(
        target_forwards=5,
        rounds=4,
        row_rounds=4,
        round_tokens=8,
        accepted_at_depth=[4, 2],
        budgets=[4, 4, 4, 4],
        outside_verify_seconds=0.1,
        verify_seconds=0.2,
    )
    deep = JetSpecStats(
        target_forwards=5,
        rounds=4,
        row_rounds=4,
        round_tokens=12,
        accepted_at_depth=[2, 1, 1],
        budgets=[4, 12, 12, 4],
        outside_verify_seconds=0.3,
        verify_seconds=0.6,
    )
    rows = [make_row("tree-4", 1.0, 1.0, stats=shallow), make_row("tree-4", 1.0, 1.0, stats=deep)]
    costs = {"target_step_seconds": 0.01, "draft_forward_seconds": 0.005, "verify": {"4": {"seconds": 0.02}}}
    figures = aggregate(rows, Method("tree-4", "tree", uses_head=True, budget=4), costs)
    assert figures["tau_mean"] == 2.5
    # per prompt [1, 0.5, 0] and [0.5, 0.25, 0.25]: the shallower tree accepted nothing at depth 3
    assert figures["acceptance_per_depth"] == [0.75, 0.375, 0.125]
    assert figures["budget_mean"] == 6.0  # per-prompt means 4 and 8
    assert figures["outside_verify_seconds_per_round"] == pytest.approx(0.05)  # 0.4 s over 8 rounds
    assert figures["verify_seconds_per_round"] == pytest.approx(0.1)
    assert figures["limit_speedup"] == pytest.approx(1.0)  # tau 2.5 * 10 ms / (20 ms + 5 ms)


def test_groups_hold_each_suite_and_all():
    rows = [
        make_row("plain", 1.0, 1.0, suite="gsm8k"),
        make_row("plain", 2.0, 1.0, suite="mtbench"),
        make_row("plain", 4.0, 1.0, suite="mtbench"),
    ]
    groups = aggregate_groups(rows, [Method("plain", "plain")], ["gsm8k", "mtbench"], costs=None)
    assert {g: figures["plain"]["prompts"] for g, figures in groups.items()} == {"gsm8k": 1, "mtbench": 2, "all": 3}


def test_summary_quotes_each_suites_speedup_and_tau():
    """The short table of results.md: per suite and over all prompts, the speedup median and (head methods) tau of
    the aggregates it reads, plain's own tokens/s, and `=/tie` over all prompts."""
    stats = JetSpecStats(target_forwards=3, rounds=2, row_rounds=2, round_tokens=8, accepted_at_depth=[2, 1])
    rows = [
        make_row("plain", 2.0, 1.0, suite="gsm8k"),
        make_row("plain", 4.0, 1.0, suite="mtbench"),
        make_row("tree-4", 1.0, 2.0, suite="gsm8k", stats=stats),
        make_row("tree-4", 1.0, 3.0, kind="tie", suite="mtbench", stats=stats),
    ]
    methods = [Method("plain", "plain"), Method("tree-4", "tree", uses_head=True, budget=4)]
    groups = aggregate_groups(rows, methods, ["gsm8k", "mtbench"], costs=None)
    lines = summary_table(groups)
    assert lines[3] == "| method | =/tie | gsm8k | mtbench | all |"
    # plain: 10 tokens in 2 s and 4 s, median 3.75 tok/s; tree-4: tau 8 round tokens / 2 rounds = 4 on each prompt
    assert lines[5] == "| plain (3.8 tok/s) | 2/0 | 1.00x | 1.00x | 1.00x |"
    assert lines[6] == "| tree-4 | 1/1 | 2.00x (4.00) | 3.00x (4.00) | 2.50x (4.00) |"


def test_rows_list_only_what_they_measured():
    plain = make_row("plain", 2.0, 1.0).as_dict()
    assert "tau" not in plain and "tie" not in plain and plain["tokens_per_s"] == 5.0
    tie = make_row("prompt_lookup", 2.0, 1.0, kind="tie").as_dict()
    assert tie["tie"] == {"kind": "tie", "position": 3, "reference_token": 7, "candidate_token": 8, "gap": 0.1}


# ------------------------------------------------------------------------------------------------ failures
@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(suites=["gsm8k", "nope"]), "unknown suite 'nope'"),
        (dict(budgets=[]), "at least one tree budget"),
        (dict(budgets=[4, 4]), "distinct tree budgets"),
        (dict(budgets=[0]), "integers >= 1, got \\[0\\]"),
        (dict(methods=["tree"]), "'plain' among the methods"),
        (dict(methods=["plain", "beam"]), "methods among .*got beam"),
        (dict(max_new_tokens=0), "max_new_tokens to be an integer >= 1, got 0"),
        (dict(limit=0), "limit to be an integer >= 1, got 0"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else "",
)
def test_bench_config_rejects_bad_settings(fields, message):
    settings = {"suites": ["gsm8k"], "budgets": [4], **fields}
    with pytest.raises(ValueError, match=message):
        BenchConfig(**settings)


@pytest.mark.parametrize(
    "suite, message",
    [("gsm8k", "tree-4.*gsm8k"), ("mtbench_turn2", "tree-4.*turn 1 of mtbench_turn2 prompt 81")],
    ids=["prompts", "conversations"],
)
def test_a_wrong_token_fails_the_run(suite, message, monkeypatch, tmp_path):
    """A drafter path that returns one wrong token must make the benchmark raise, not report a speedup; in a
    conversation, on the first turn it reaches, before turn 2."""
    target, head = tiny_pair()
    original = JetSpecDraftModel.tree_generate

    def wrong_last_token(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        out.sequences[:, -1] = (out.sequences[:, -1] + 1) % target.config.vocab_size
        return out

    monkeypatch.setattr(JetSpecDraftModel, "tree_generate", wrong_last_token)
    config = BenchConfig([suite], [4], 6, limit=1, methods=("plain", "tree"), warmup=False, cost_repeats=1)
    with pytest.raises(LosslessError, match=message):
        run_benchmark(target, char_tokenizer(), head, config, tmp_path, progress=False)
    assert not (tmp_path / "results.json").exists()


def test_a_failing_auto_budget_fails_the_run(monkeypatch, tmp_path):
    """No method is optional: a broken `auto` is a failure, not a row marked unavailable."""
    target, head = tiny_pair()
    original = JetSpecDraftModel.tree_generate

    def no_auto(self, *args, **kwargs):
        if kwargs.get("tree_budget") == "auto":
            raise NotImplementedError("tree_budget='auto' broke")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(JetSpecDraftModel, "tree_generate", no_auto)
    config = BenchConfig(["gsm8k"], [4], 6, limit=2, methods=("plain", "tree", "auto"), cost_repeats=1)
    with pytest.raises(NotImplementedError, match="auto' broke"):
        run_benchmark(target, char_tokenizer(), head, config, tmp_path, progress=False)


def test_a_baseline_head_runs_every_head_method_beside_the_head(monkeypatch, tmp_path):
    """`baseline_head`: each head method runs once more, drafted by the second head, on the same prompts; both
    heads' outputs equal plain greedy, and each row's statistics come from its own head's call."""
    target, head = tiny_pair()
    baseline = tiny_head(target, seed=7, tree_depth=4, tree_width=3, tree_budget=12)
    baseline.name_or_path = "org/baseline-head"  # as a Hub id: recorded as given
    used = []
    original = target.generate

    def generate(*args, **kwargs):
        if "custom_generate" not in kwargs:  # outer calls only: which head drafted, if any
            used.append(kwargs.get("assistant_model"))
        return original(*args, **kwargs)

    monkeypatch.setattr(target, "generate", generate)
    config = BenchConfig([SUITES[0]], [4], MAX_NEW, limit=1, methods=["plain", "tree"], cost_repeats=2)
    results = run_benchmark(target, char_tokenizer(), head, config, tmp_path, progress=False, baseline_head=baseline)
    assert results["config"]["methods"] == ["plain", "tree-4", "tree-4@baseline"]
    assert results["config"]["method_arguments"]["tree-4@baseline"] == results["config"]["method_arguments"]["tree-4"]
    assert results["config"]["baseline_head"] == "org/baseline-head"
    # no folder behind a Hub id: nothing to digest; the head's identity is recorded beside it
    assert results["config"]["baseline_head_identity"] == {"weights_sha256": None, "commit": None, "committed": None}
    assert set(results["config"]["head_identity"]) == {"weights_sha256", "commit", "committed"}
    assert [r["equality"] for r in results["prompts"]] == ["exact"] * 3
    # (a) warm-up then the measured prompt: plain without a head, tree-4 with the head, its copy with the baseline
    assert sum(h is head for h in used) == 2 and sum(h is baseline for h in used) == 2
    assert sum(h is None for h in used) == 2
    rows = {r["method"]: r for r in results["prompts"]}
    assert rows["tree-4"]["new_tokens"] == rows["tree-4@baseline"]["new_tokens"] == MAX_NEW
    assert "tree-4@baseline" in (tmp_path / "results.md").read_text()
