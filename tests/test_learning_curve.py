"""The learning curve the trainer ships: held-out agreement against steps and against the target tokens seen."""

import pytest

from training.run_outputs import write_learning_curve


def _evals(with_tokens: bool):
    history = [{"loss": 3.0, "step": 10}]  # a training log: not a point of the curve
    for step, acc in ((100, 0.30), (200, 0.40)):
        entry = {"step": step, "eval_acc_depth_1": acc, "eval_acc_depth_2": acc / 2}
        if with_tokens:
            entry["num_input_tokens_seen"] = step * 2000
        history.append(entry)
    return history


def test_curve_has_a_tokens_panel_when_the_trainer_counted_tokens(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    panels = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: panels.append(self.axes))
    assert write_learning_curve(_evals(True), tmp_path / "curve.png") is not None
    (axes,) = panels
    assert [a.get_xlabel() for a in axes] == ["training step", "target tokens seen (millions)"]
    # (a) the tokens panel plots the counted tokens, in millions, one line per depth
    lines = axes[1].get_lines()
    assert len(lines) == 2
    assert list(lines[0].get_xdata()) == pytest.approx([0.2, 0.4])  # 200,000 and 400,000 tokens, scaled
    assert list(lines[0].get_ydata()) == [0.30, 0.40]


def test_curve_without_token_counts_keeps_the_steps_panel_only(tmp_path):
    path = write_learning_curve(_evals(False), tmp_path / "curve.png")
    assert path.is_file() and path.stat().st_size > 0
    assert write_learning_curve([{"loss": 1.0, "step": 1}], tmp_path / "none.png") is None
