"""The README is for users (issue 55): at most 200 lines; the head it names is the one in `jetspec/heads/`, and every
bench it links measured that head; its set-up commands are the ones `.ci/run` runs; every relative link resolves.

History, earlier heads and campaigns live in `docs/results.md`; a figure of another head in the README fails here
through its digest or its result file."""

import json
import re
from pathlib import Path

from jetspec.provenance import weights_digest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SHIPPED = ROOT / "jetspec" / "heads" / "smollm2-135m"
MAX_LINES = 200
LINK = re.compile(r"\]\(([^)\s]+)\)")
DIGEST = re.compile(r"(?<![0-9a-f])[0-9a-f]{16}(?![0-9a-f])")


def readme() -> str:
    return README.read_text(encoding="utf-8")


def relative_links(text: str) -> list:
    """The link targets of `[text](target)` that point into the repository (no scheme, no pure `#anchor`), without
    their `#anchor`."""
    targets = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def ci_install_lines() -> list:
    """The `pip install` commands of `.ci/run`, each as the words after `pip install`."""
    lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    commands = [line.split("#", 1)[0].strip() for line in lines if line.lstrip().startswith("python -m pip install")]
    return [command.split("pip install", 1)[1].split() for command in commands if "--upgrade pip" not in command]


def readme_set_up() -> tuple:
    """The README's set-up block (the first code block under `## Set up`): its install line split at `&&` into the
    words after each `pip install`, and its test command."""
    section = readme().split("## Set up", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    installs = [part.split("pip install", 1)[1].split() for part in block[0].split("&&")]
    return installs, block[1].strip()


def test_the_readme_is_short():
    lines = len(readme().splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines; history and campaigns go to docs/results.md"


def test_the_readme_names_the_shipped_head_only():
    shipped = weights_digest(SHIPPED)
    named = set(DIGEST.findall(readme()))
    assert shipped in named, f"the README does not name the shipped head by its weights digest {shipped}"
    assert named == {shipped}, f"the README names other weights than the shipped head's {shipped}: {named - {shipped}}"


def test_every_bench_the_readme_links_measured_the_shipped_head():
    shipped = weights_digest(SHIPPED)
    benches = []
    for target in relative_links(readme()):
        path = ROOT / target
        folder = path if path.is_dir() else path.parent
        if (path.is_dir() or path.name in ("results.md", "results.json")) and (folder / "results.json").is_file():
            identity = json.loads((folder / "results.json").read_text(encoding="utf-8"))["config"].get("head_identity")
            benches.append(target)
            assert identity and identity["weights_sha256"] == shipped, f"{target} measured {identity}, not {shipped}"
    assert benches, "the README links no bench result of the shipped head"


def test_the_set_up_commands_are_the_ones_ci_runs():
    installs, test_command = readme_set_up()
    assert installs == ci_install_lines()[: len(installs)], (installs, ci_install_lines())
    assert len(installs) == 3
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert test_command == "python -m pytest -q" and test_command in ci.splitlines()


def test_every_relative_link_resolves():
    links = relative_links(readme())
    assert len(links) >= 5, links
    missing = [target for target in links if not (ROOT / target).exists()]
    assert not missing, f"README.md links to files that are not in the repository: {missing}"


def test_the_link_reader_skips_urls_and_anchors():
    text = "[a](docs/x.md#part) [b](https://example.org/y) [c](#results) [d](results/z/)"
    assert relative_links(text) == ["docs/x.md", "results/z/"]
