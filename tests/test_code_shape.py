"""`modeling_jetspec/` reads one function per screen: every function (methods and nested functions included) is at
most 60 lines long, docstring included, counted from its `def` line to its last line; and every file of it is under
700 lines (a file that grows past them holds more than one thing: split it by what each part owns)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "modeling_jetspec"
LIMIT = 60
FILE_LIMIT = 700


def function_lengths(path: Path) -> dict:
    """`{qualified name: lines}` of every function of a source file."""
    lengths = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            name = f"{prefix}{getattr(child, 'name', '')}"
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lengths[name] = child.end_lineno - child.lineno + 1
            visit(
                child,
                f"{name}." if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else prefix,
            )

    visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return lengths


def test_the_counter_sees_every_function():
    lengths = function_lengths(PACKAGE / "modeling_jetspec.py")
    assert "JetSpecDraftModel.forward" in lengths and "JetSpecDraftModel.draft" in lengths
    assert "stack_target_states" in lengths and lengths["stack_target_states"] > 5


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_every_function_fits_on_a_screen(path):
    long = {name: n for name, n in function_lengths(path).items() if n > LIMIT}
    assert not long, f"functions over {LIMIT} lines in {path.name}: {long}"


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_every_file_is_under_700_lines(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines < FILE_LIMIT, f"{path.name} has {lines} lines"
