"""Where each committed token came from, for `jetspec generate --show-drafts`.

A tree round commits the draft tokens the target accepted, then the target's own bonus token; the call's first
token also is the target's (its prefill). `JetSpecStats.accepted` holds, per round, how many draft tokens each row
accepted, so the answer splits into rounds after the fact. A draft token is attributed to the prompt-lookup branch
when it lies on that round's lookup continuation (the tokens after the most recent earlier occurrence of the row's
last 3, 2 or 1 tokens, `tree.lookup_match`; with `tree_lookup_branches="trie"`, on any earlier continuation,
`continuations.continuation_trie`), and to the head otherwise; a token both proposed counts as lookup. Both are read
from one `continuations.NgramIndex` grown round by round (what the rounds themselves do), so attributing a call's
tokens costs what its rounds read, not a scan of the history per round (`jetspec serve` does it for every answer).
"""

from __future__ import annotations

from modeling_jetspec.continuations import NgramIndex

SOURCES = ("head", "lookup", "target")
_COLOURS = {"head": "\033[32m", "lookup": "\033[36m", "target": ""}  # green, cyan, the terminal's own
_RESET = "\033[0m"
_BRACKETS = {"head": ("[", "]"), "lookup": ("{", "}"), "target": ("", "")}


def token_sources(prompt_ids: list, new_tokens: list, accepted: list, lookup: int, branches: str = "chain") -> list:
    """One of `"head"`, `"lookup"`, `"target"` per new token of a batch-1 call.

    Args:
        prompt_ids (`list[int]`): the prompt.
        new_tokens (`list[int]`): the committed tokens after it.
        accepted (`list`): `JetSpecStats.accepted`, per round `[draft tokens accepted]` (one row).
        lookup (`int`): the call's `tree_lookup` (0: no lookup branch, every draft token is the head's).
        branches (`str`, *optional*, defaults to `"chain"`): the call's `tree_lookup_branches`.
    """
    if any(len(row) != 1 for row in accepted):
        raise ValueError(f"expected the statistics of a batch-1 call (one row per round), got {accepted[:3]}...")
    sources = ["target"] if new_tokens else []  # the prefill's token
    start = 1
    index = NgramIndex()  # grown round by round: the same tries and chains as a scan of each round's history
    for (count,) in accepted:
        drafted = new_tokens[start : start + count]
        trie = {}
        if lookup and count:  # a round that accepted no draft token needs no branch
            index.update(prompt_ids + new_tokens[:start])
            if branches == "trie":
                trie = index.trie(lookup)[0]
            else:  # the single chain as a trie of one branch
                chain = index.chain(lookup)[0]
                trie = {tuple(chain[:k]): {token: 1} for k, token in enumerate(chain)}
        on_branch = True
        for k, token in enumerate(drafted):
            on_branch = on_branch and token in trie.get(tuple(drafted[:k]), {})
            sources.append("lookup" if on_branch else "head")
        if start + count < len(new_tokens):
            sources.append("target")  # the round's bonus token
        start += count + 1
    if len(sources) != len(new_tokens):
        raise ValueError(
            f"expected the rounds to account for {len(new_tokens)} tokens, got {len(sources)}: statistics of another call?"
        )
    return sources


def render(tokenizer, tokens: list, sources: list, colour: bool) -> str:
    """The answer with runs of one source marked: coloured (head green, lookup cyan, target plain) or, in plain
    text, head tokens in `[...]` and lookup tokens in `{...}`."""
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
        return f"{_COLOURS['head']}head{_RESET}  {_COLOURS['lookup']}lookup{_RESET}  target (bonus)"
    return "[head]  {lookup}  target (bonus)"


def counts(sources: list) -> str:
    total = max(len(sources), 1)
    return ", ".join(f"{name} {sources.count(name)} ({100 * sources.count(name) / total:.0f}%)" for name in SOURCES)
