"""Where each committed token came from, for `jetspec generate --show-drafts` and the serve statistics.

The round records it as it commits (`JetSpecStats.token_sources`, one list per batch row): "head" (the head's
draft), "lookup" (the model-free branch: the prompt-lookup chain, or with `tree_lookup_branches="trie"` any earlier
continuation), "both" (the head and the branch proposed it) or "target" (the target's own choice: the prefill's
token and each round's bonus token). The rule is `modeling_jetspec.calibration.node_source`, the one the calibrated
tree scores read; this module only reads the record and shows it.
"""

from __future__ import annotations

from modeling_jetspec.calibration import TOKEN_SOURCES

SOURCES = TOKEN_SOURCES  # ("head", "lookup", "both", "answers", "target"): "answers" only with an answer cache
_COLOURS = {
    "head": "\033[32m",
    "lookup": "\033[36m",
    "both": "\033[33m",
    "answers": "\033[35m",
    "target": "",
}  # green, cyan, yellow, magenta
_RESET = "\033[0m"
_BRACKETS = {"head": ("[", "]"), "lookup": ("{", "}"), "both": ("<", ">"), "answers": ("|", "|"), "target": ("", "")}


def row_sources(stats, new_tokens: list, row: int = 0) -> list:
    """The recorded source of each of `new_tokens`, the new tokens of batch row `row` of the call whose statistics
    are `stats` (`JetSpecStats`); a `ValueError` when the record does not hold one source per token (statistics of
    another call)."""
    recorded = stats.token_sources
    sources = recorded[row] if row < len(recorded) else []
    if len(sources) != len(new_tokens):
        raise ValueError(
            f"expected one recorded source per new token of row {row} ({len(new_tokens)}), got {len(sources)}: "
            "statistics of another call?"
        )
    return list(sources)


def render(tokenizer, tokens: list, sources: list, colour: bool) -> str:
    """The answer with runs of one source marked: coloured (head green, lookup cyan, both yellow, target plain) or,
    in plain text, head tokens in `[...]`, lookup tokens in `{...}` and tokens both proposed in `<...>`."""
    runs, text = [], ""
    for token, source in zip(tokens, sources):
        if runs and runs[-1][0] == source:
            runs[-1][1].append(token)
        else:
            runs.append((source, [token]))
    for source, ids in runs:
        piece = tokenizer.decode(ids, skip_special_tokens=True)
        if colour and _COLOURS[source]:
            text += f"{_COLOURS[source]}{piece}{_RESET}"
        else:
            left, right = _BRACKETS[source] if not colour else ("", "")
            text += f"{left}{piece}{right}"
    return text


def legend(colour: bool) -> str:
    if colour:
        names = [f"{_COLOURS[name]}{name}{_RESET}" for name in ("head", "lookup", "both")]
        return "  ".join(names) + "  target (bonus)"
    return "[head]  {lookup}  <both>  target (bonus)"


def counts(sources: list) -> str:
    """Tokens per source, with its share; "answers" only where an answer cache proposed some."""
    total = max(len(sources), 1)
    named = [name for name in SOURCES if name != "answers" or name in sources]
    return ", ".join(f"{name} {sources.count(name)} ({100 * sources.count(name) / total:.0f}%)" for name in named)
