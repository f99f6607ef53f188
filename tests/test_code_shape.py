"""The code reads one room per file and one function per screen, and reaches its packages the ordinary way.

Over every non-test Python file of `jetspec/`, `modeling_jetspec/`, `training/` and `scripts/`:

- a file is at most 600 lines long (a file that grows past that holds more than one thing: split it by what each part
  owns);
- a function (methods and nested functions included) is at most 80 lines long, 60 in `modeling_jetspec/`, docstring
  included, counted from its `def` line to its last line;
- nothing edits `sys.path` (scripts run as `python -m scripts.<name>`, training as `python -m training.<name>`);
- no name with a leading underscore is imported from another of these packages (a private name is its module's own);

and `results/` holds no code (the drivers of finished measurements live in `scripts/campaigns/`).
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jetspec", "modeling_jetspec", "training", "scripts")
FILE_LIMIT = 600
FUNCTION_LIMIT = 80
FUNCTION_LIMITS = {"modeling_jetspec": 60}  # the remote code reads tighter


def source_files() -> list[str]:
    """Every non-test Python file of the packages, as a path relative to the repository root."""
    files = []
    for package in PACKAGES:
        files += [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / package).rglob("*.py"))]
    return [f for f in files if "/tests/" not in f and "__pycache__" not in f]


CHECKED = source_files()  # no allow-list: every file keeps every rule


def function_lengths(source: str) -> dict:
    """`{qualified name: lines}` of every function of a source text."""
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

    visit(ast.parse(source), "")
    return lengths


def sys_path_uses(source: str) -> list[int]:
    """Lines that touch `sys.path` (an insert, an append, an assignment: any use)."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    ]


def private_imports(source: str, package: str) -> list[str]:
    """`module.name` of every private name (leading underscore, in the module path or the name) that `source`, a file
    of `package`, imports from another of the packages."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] not in PACKAGES or parts[0] == package:
                continue
            private_module = any(part.startswith("_") and part != "__init__" for part in parts)
            found += [
                f"{node.module}.{alias.name}" for alias in node.names if private_module or alias.name.startswith("_")
            ]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in PACKAGES and parts[0] != package and any(p.startswith("_") for p in parts):
                    found.append(alias.name)
    return found


def read(path: str) -> str:
    return (ROOT / path).read_text(encoding="utf-8")


def test_the_checks_see_what_they_look_for():
    lengths = function_lengths("class A:\n    def f(self):\n        def g():\n            pass\n        return g\n")
    assert lengths == {"A.f": 4, "A.f.g": 2}
    assert sys_path_uses("import sys\n\nsys.path.insert(0, '.')\n") == [3]
    assert sys_path_uses("import sys\nprint(sys.argv)\n") == []
    source = "from training.answers import _generate_shard, compact_ids\nimport training._private\n"
    assert private_imports(source, "scripts") == ["training.answers._generate_shard", "training._private"]
    assert private_imports(source, "training") == []  # a package's own private names are its own
    assert private_imports("from transformers import _x\n", "scripts") == []  # other libraries: not these rules
    real = function_lengths(read("modeling_jetspec/tree.py"))
    assert real and max(real.values()) > 5


def test_every_source_file_is_seen():
    files = source_files()
    for expected in ("jetspec/tiny.py", "modeling_jetspec/tree.py", "training/step_timer.py", "scripts/gpu_check.py"):
        assert expected in files
    assert "scripts/campaigns/depth_table.py" in files


@pytest.mark.parametrize("path", CHECKED)
def test_every_file_is_at_most_600_lines(path):
    lines = len(read(path).splitlines())
    assert lines <= FILE_LIMIT, f"{path} has {lines} lines (at most {FILE_LIMIT})"


@pytest.mark.parametrize("path", CHECKED)
def test_every_function_fits_on_a_screen(path):
    limit = FUNCTION_LIMITS.get(path.split("/")[0], FUNCTION_LIMIT)
    long = {name: n for name, n in function_lengths(read(path)).items() if n > limit}
    assert not long, f"functions over {limit} lines in {path}: {long}"


@pytest.mark.parametrize("path", CHECKED)
def test_nothing_edits_sys_path(path):
    assert not sys_path_uses(read(path)), f"{path} touches sys.path at lines {sys_path_uses(read(path))}"


@pytest.mark.parametrize("path", CHECKED)
def test_no_private_name_is_imported_across_packages(path):
    found = private_imports(read(path), path.split("/")[0])
    assert not found, f"{path} imports private names of another package: {found}"


def test_results_hold_no_code():
    code = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "results").rglob("*.py"))
    assert not code, f"code under results/ (move it to scripts/campaigns/): {code}"
