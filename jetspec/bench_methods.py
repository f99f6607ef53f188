"""The benchmark's settings: which methods `jetspec bench` runs, with which `generate` arguments
(`jetspec.bench` runs them; the methods are described in its docstring)."""

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .equality import DEFAULT_TIE_TOLERANCE
from .prompts import check_suites

METHOD_KINDS = (
    "plain",
    "prompt_lookup",
    "chain",
    "tree",
    "auto",
    "path_conditioning",
    "lookup",
    "lookup_first",
    "gap",
    "lookup_gap",
    "trie",
    "answers",
)
DEFAULT_METHODS = METHOD_KINDS[:-2]  # the trie and the answer cache are asked for by name
PROMPT_LOOKUP_TOKENS = 10


def check_budgets(budgets: Sequence[int]) -> list[int]:
    """Validated list of tree budgets (integers >= 1, at least one, distinct)."""
    budgets = list(budgets)
    if not budgets:
        raise ValueError("expected at least one tree budget, got an empty list")
    bad = [b for b in budgets if isinstance(b, bool) or not isinstance(b, int) or b < 1]
    if bad:
        raise ValueError(f"expected tree budgets that are integers >= 1, got {bad}")
    if len(set(budgets)) != len(budgets):
        raise ValueError(f"expected distinct tree budgets, got {budgets}")
    return budgets


def check_method_kinds(kinds: Sequence[str]) -> list[str]:
    """Validated method kinds: known, each once, `"plain"` among them (every output is checked against it)."""
    kinds = list(kinds)
    unknown = [k for k in kinds if k not in METHOD_KINDS]
    if unknown:
        raise ValueError(f"expected methods among {', '.join(METHOD_KINDS)}, got {', '.join(map(str, unknown))}")
    if "plain" not in kinds:
        raise ValueError(f"expected 'plain' among the methods (every output is checked against it), got {kinds}")
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"expected each method once, got {kinds}")
    return kinds


@dataclass
class BenchConfig:
    """What one benchmark run measures; validated on construction (bad values raise `ValueError`)."""

    # prompt suites among `jetspec.prompts.SUITES`, conversations (decoded turn by turn) among its `CONVERSATIONS`
    suites: Sequence[str]
    budgets: Sequence[int]  # tree budgets B; one `tree-B` method each (and one `tree-B-lookup`, ...)
    max_new_tokens: int = 256  # tokens generated per prompt (fewer when the target stops)
    limit: Optional[int] = 10  # the first `limit` prompts of each suite; None for all
    methods: Sequence[str] = DEFAULT_METHODS  # method kinds among METHOD_KINDS, "plain" included
    warmup: bool = True  # run every method once, untimed, on the first prompt (at most 8 new tokens)
    cost_repeats: int = 10  # timed repeats of each forward in `measure_costs`
    tie_tolerance: float = DEFAULT_TIE_TOLERANCE  # float32 logit gap still called a tie (half precisions)

    def __post_init__(self):
        self.suites = check_suites(self.suites, conversations=True)
        self.budgets = check_budgets(self.budgets)
        self.methods = check_method_kinds(self.methods)
        for name in ("max_new_tokens", "cost_repeats") + (("limit",) if self.limit is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"expected {name} to be an integer >= 1, got {value!r}")


@dataclass
class Method:
    name: str  # row label: "plain", "prompt_lookup", "chain", "tree-16", "auto", "tree-16-lookup", ...
    kind: str  # one of METHOD_KINDS
    generate_kwargs: dict = field(default_factory=dict)  # extra arguments of `target.generate`
    uses_head: bool = False
    budget: Optional[int] = None  # draft nodes per round, when fixed
    baseline: bool = False  # drafted by the run's baseline head (`name` ends in "@baseline") instead of its head


def with_baseline(plan: Sequence[Method]) -> list[Method]:
    """`plan` followed by a copy of each of its head methods drafted by the baseline head, named `<name>@baseline`,
    with the same `generate` arguments: two heads side by side in one process, on the same prompts and plain run."""
    copies = [dataclasses.replace(m, name=f"{m.name}@baseline", baseline=True) for m in plan if m.uses_head]
    return list(plan) + copies


def build_methods(
    kinds: Sequence[str],
    budgets: Sequence[int],
    chain_depth: int,
    default_budget: int = 32,
    lookup_tokens: Optional[int] = None,
) -> list[Method]:
    """The measured methods, in the order of `kinds`.

    `"tree"`, `"lookup"`, `"lookup_first"`, `"gap"`, `"lookup_gap"` and `"trie"` expand to one method per budget (the `gap`
    kinds shape the tree with `tree_scoring="gap"`, see docs/design.md); `"path_conditioning"` is the tree at
    `default_budget`; the lookup branch holds `lookup_tokens` tokens, by default `chain_depth`. `chain`, `tree-B`
    and `tree-B-pc` measure the head alone: they set `tree_lookup=0` whatever the head's default; `auto` runs the
    operating point `tree_budget="auto"` chooses, its draft sources included.
    """
    lookup_tokens = lookup_tokens or chain_depth
    per_budget = {  # kind -> (name suffix, arguments besides the budget)
        "tree": ("", {"tree_lookup": 0}),
        "lookup": ("-lookup", {"tree_lookup": lookup_tokens}),
        "lookup_first": ("-lookup-first", {"tree_lookup": lookup_tokens, "tree_lookup_prior": False}),
        "gap": ("-gap", {"tree_lookup": 0, "tree_scoring": "gap"}),
        "lookup_gap": ("-lookup-gap", {"tree_lookup": lookup_tokens, "tree_scoring": "gap"}),
        # every earlier continuation of the matched n-gram (continuations.py) instead of the latest one
        "trie": ("-trie", {"tree_lookup": lookup_tokens, "tree_lookup_branches": "trie"}),
    }
    chain = {"tree_depth": chain_depth, "tree_width": 1, "tree_budget": chain_depth, "tree_lookup": 0}
    single = {
        "plain": Method("plain", "plain"),
        "prompt_lookup": Method("prompt_lookup", "prompt_lookup", {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}),
        "chain": Method("chain", "chain", chain, uses_head=True, budget=chain_depth),
        # the operating point the head's tau table and this host's costs choose: budget and draft sources
        "auto": Method("auto", "auto", {"tree_budget": "auto"}, uses_head=True),
        # the head's lookup branch (the one the cache drafts in) and an answer cache shared by the run's prompts
        # (`Bench.answer_caches`): each prompt drafts also from the answers of the prompts before it
        "answers": Method("answers", "answers", {"tree_lookup": lookup_tokens}, uses_head=True),
        "path_conditioning": Method(
            f"tree-{default_budget}-pc",
            "path_conditioning",
            {"tree_budget": default_budget, "path_conditioning": True, "tree_lookup": 0},
            uses_head=True,
            budget=default_budget,
        ),
    }
    methods = []
    for kind in check_method_kinds(kinds):
        if kind in single:
            methods.append(single[kind])
            continue
        suffix, extra = per_budget[kind]
        methods += [
            Method(f"tree-{b}{suffix}", kind, {"tree_budget": b, **extra}, uses_head=True, budget=b) for b in budgets
        ]
    return methods
