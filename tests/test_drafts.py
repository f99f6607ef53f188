"""`jetspec.drafts`: the round's record of where each token came from, read for `--show-drafts` and shown."""

import pytest

from jetspec.drafts import counts, legend, render, row_sources
from modeling_jetspec.state import JetSpecStats


class Letters:
    """A tokenizer stand-in: id i decodes to the i-th lowercase letter."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


def recorded(*rows) -> JetSpecStats:
    stats = JetSpecStats()
    for row, sources in enumerate(rows):
        stats.add_sources(row, list(sources))
    return stats


def test_a_row_s_recorded_sources_are_read_for_its_new_tokens():
    stats = recorded(["target", "head", "both", "target"], ["target", "lookup"])
    assert row_sources(stats, [9, 4, 5, 7]) == ["target", "head", "both", "target"]
    assert row_sources(stats, [3, 1], row=1) == ["target", "lookup"]


def test_a_record_of_another_call_is_refused():
    stats = recorded(["target", "head"])
    with pytest.raises(ValueError, match=r"one recorded source per new token of row 0 \(3\), got 2"):
        row_sources(stats, [1, 2, 3])
    with pytest.raises(ValueError, match=r"row 1 \(1\), got 0"):
        row_sources(stats, [1], row=1)


def test_sources_past_the_output_s_end_are_cut():
    # row 0 committed 2 tokens past the output's end (it had stopped, and a last round ran on): they go
    stats = recorded(["target", "head", "head", "target", "head"], ["target", "lookup", "target"])
    stats.cut_sources([15, 13], end=13)
    assert stats.token_sources == [["target", "head", "head"], ["target", "lookup", "target"]]


def test_render_marks_runs_in_plain_text_and_colour():
    sources = ["target", "head", "head", "lookup", "both", "target"]
    assert render(Letters(), [0, 1, 2, 3, 4, 5], sources, colour=False) == "a[bc]{d}<e>f"
    coloured = render(Letters(), [0, 1, 2, 3, 4, 5], sources, colour=True)
    assert coloured == "a\033[32mbc\033[0m\033[36md\033[0m\033[33me\033[0mf"
    assert counts(sources) == "head 2 (33%), lookup 1 (17%), both 1 (17%), target 2 (33%)"
    assert legend(colour=False) == "[head]  {lookup}  <both>  target (bonus)"
