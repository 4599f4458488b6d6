"""The user documents hold together: links resolve, the key reference matches the schema.

Run: ``python -m pytest -q tests/test_docs.py``. Regenerate the key reference with
``python -m slidedp.docs_config`` when a config key changes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from slidedp import docs_config

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "benchmarks").glob("*.md")]
)
USER_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation out, '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor on ``page``, duplicates numbered as GitHub numbers them."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*$", line)
        if match:
            base = github_anchor(match.group(1))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> list[str]:
    """Relative link targets of ``page`` outside code (web links and mail skipped)."""
    text = INLINE_CODE.sub("", FENCE.sub("", page.read_text()))
    targets = [a or b for a, b in LINK.findall(text)]
    return [t for t in targets if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.exists() and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor '#{anchor}' in {dest.name}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_anchor_rule_matches_github() -> None:
    # GitHub's slugger: backticks and punctuation dropped, spaces to '-', '-' and '_' kept
    assert github_anchor("Several GPUs (or CPU ranks)") == "several-gpus-or-cpu-ranks"
    assert github_anchor("Layer compute: fused kernels") == "layer-compute-fused-kernels"
    assert github_anchor("`runtime.policy: auto`") == "runtimepolicy-auto"
    assert github_anchor("The host engine (Rust, `crates/x`)") == "the-host-engine-rust-cratesx"


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# Title\n[ok](#title) [gone](missing.md) `[code](nope.md)`\n")
    assert links(page) == ["#title", "missing.md"]
    assert anchors(page) == {"title"}


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_user_pages_carry_no_internal_vocabulary(page: Path) -> None:
    text = page.read_text()
    assert "../shared" not in text, "a user does not have ../shared"
    bad = re.findall(
        r"\blease[sd]?\b|\bissue #?\d+|#\d{1,3}\b(?!\w)|\bthis session\b|\bbookings?\b|"
        r"\bdevice calls?\b|\ba later call\b",
        text,
        re.I,
    )
    assert not bad, f"{page.name}: internal vocabulary {sorted(set(bad))}"


def test_readme_is_a_funnel() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines (at most 250)"
    first_block = FENCE.search("\n".join(lines))
    assert first_block is not None
    commands = [c.split("#")[0].strip() for c in first_block.group(0).splitlines()[1:3]]
    assert commands == ["make demo", "make test"], "the README's first commands"
    cells = [
        cell.strip()
        for line in lines
        if line.lstrip().startswith("|")
        for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))
    ]
    longest = max((len(c) for c in cells), default=0)
    assert longest <= 200, f"a README table cell has {longest} characters (at most 200)"


def test_config_reference_covers_the_schema() -> None:
    problems = docs_config.problems(docs_config.load_descriptions())
    assert not problems, "docs/config_keys.yaml: " + "; ".join(problems)


def test_config_reference_page_is_current() -> None:
    page = (REPO / "docs" / "configuration.md").read_text()
    assert page == docs_config.render(docs_config.load_descriptions()), (
        "docs/configuration.md is stale: run python -m slidedp.docs_config"
    )


def test_config_reference_check_catches_drift(tmp_path: Path) -> None:
    descriptions = docs_config.load_descriptions()
    missing = dict(descriptions)
    del missing["train.max_steps"]
    assert docs_config.problems(missing) == ["no description for key 'train.max_steps'"]
    stray = {**descriptions, "train.max_stpes": "typo"}
    assert docs_config.problems(stray) == ["description of 'train.max_stpes' names no key"]
    assert "| `max_steps` | int | **required** |" in docs_config.render(descriptions)


@dataclass(kw_only=True)
class _Launch:
    gpus: int = 1
    route: Literal["gpu", "cpu"] = "gpu"


@dataclass(kw_only=True)
class _Runtime:
    slots: int = 2
    launch: _Launch = field(default_factory=_Launch)


@dataclass(kw_only=True)
class _Config:
    runtime: _Runtime = field(default_factory=_Runtime)


def test_walk_follows_how_the_yaml_nests_a_sub_dataclass() -> None:
    nested = {"runtime": {"slots": 2, "launch": {"gpus": 1, "route": "gpu"}}}
    sections, keys = docs_config.walk(_Config, tree=nested)
    assert sections == ["runtime", "runtime.launch"]
    assert [k.path for k in keys] == [
        "runtime.slots",
        "runtime.launch.gpus",
        "runtime.launch.route",
    ]
    flat = {"runtime": {"slots": 2, "gpus": 1, "route": "gpu"}}  # sub-dataclass, YAML keys kept
    sections, keys = docs_config.walk(_Config, tree=flat)
    assert sections == ["runtime"]
    assert [k.path for k in keys] == ["runtime.slots", "runtime.gpus", "runtime.route"]
    assert keys[2].type_text == "`gpu` \\| `cpu`"
    assert keys[2].default_text == "`gpu`"
