"""`jetspec.drafts`: each committed token attributed to the head, the prompt-lookup branch or the target."""

import pytest

from jetspec.drafts import counts, render, token_sources


class Letters:
    """A tokenizer stand-in: id i decodes to the i-th lowercase letter."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


def test_rounds_split_into_drafts_and_bonus_tokens():
    # prompt "a b c d"; the prefill commits 9; round 1 accepts 2 drafts (4, 5) + bonus 7; round 2 accepts none + bonus 8
    prompt, new = [0, 1, 2, 3], [9, 4, 5, 7, 8]
    assert token_sources(prompt, new, [[2], [0]], lookup=0) == ["target", "head", "head", "target", "target"]


def test_drafts_on_the_lookup_continuation_count_as_lookup():
    # "1 2" occurred before, followed by "3 4": after the anchor 2 the lookup chain is 3 4 5 ...
    prompt = [1, 2, 3, 4, 5, 6, 1]
    new = [2, 3, 4, 9, 6]  # prefill 2; round: drafts 3 4 (on the chain) then 9 (off it), bonus 6
    assert token_sources(prompt, new, [[3]], lookup=8) == ["target", "lookup", "lookup", "head", "target"]
    # without the lookup branch in the call, the same drafts are the head's
    assert token_sources(prompt, new, [[3]], lookup=0) == ["target", "head", "head", "head", "target"]


def test_with_the_trie_every_earlier_continuation_counts_as_lookup():
    # "1 2" continued "3 4" first and "5 6" later: the chain holds only the latest, the trie both
    prompt = [1, 2, 3, 4, 1, 2, 5, 6, 1]
    new = [2, 3, 4, 7]  # prefill 2; round: drafts 3 4 (the earlier continuation), bonus 7
    assert token_sources(prompt, new, [[2]], lookup=8) == ["target", "head", "head", "target"]
    assert token_sources(prompt, new, [[2]], lookup=8, branches="trie") == ["target", "lookup", "lookup", "target"]


def test_a_final_round_cut_by_the_stop_has_no_bonus():
    assert token_sources([0, 1], [5, 6, 7], [[3]], lookup=0) == ["target", "head", "head"]


def test_statistics_of_another_call_are_refused():
    with pytest.raises(ValueError, match="batch-1"):
        token_sources([0], [1, 2], [[1, 0]], lookup=0)
    with pytest.raises(ValueError, match="account for 6 tokens, got 3"):
        token_sources([0], [1, 2, 3, 4, 5, 6], [[1]], lookup=0)


def test_render_marks_runs_in_plain_text_and_colour():
    sources = ["target", "head", "head", "lookup", "target"]
    assert render(Letters(), [0, 1, 2, 3, 4], sources, colour=False) == "a[bc]{d}e"
    coloured = render(Letters(), [0, 1, 2, 3, 4], sources, colour=True)
    assert coloured == "a\033[32mbc\033[0m\033[36md\033[0me"
    assert counts(sources) == "head 2 (40%), lookup 1 (20%), target 2 (40%)"
