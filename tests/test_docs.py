"""The repository's prose: every relative link of README.md, docs/ and benchmarks/ resolves (to a heading
where it names one), the README keeps the quick-start and test commands CI and users run, and no page
outgrows its size limit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted([README, *(ROOT / "docs").rglob("*.md"), *(ROOT / "benchmarks").rglob("*.md")])
QUICK_START = (
    "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/rollplex train",
    'python3 -m venv .venv && .venv/bin/pip install -e ".[test]" && .venv/bin/python -m pytest -q',
)
TEST_COMMAND = "python -m pytest -q"  # what .ci/run runs
README_LIMIT, PAGE_LIMIT = 12 * 1024, 16 * 1024  # bytes

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.DOTALL | re.MULTILINE)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans, where brackets are not links."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def relative_links(text: str) -> list[str]:
    """The targets of the Markdown links and images of ``text`` that are not URLs (``http:``, ...)."""
    return [t for t in _LINK.findall(prose(text)) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` removed, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of the headings of a Markdown text (a repeated heading's ``-1``, ``-2``, ... too)."""
    found: set[str] = set()
    for line in _FENCE.sub("", text).splitlines():
        heading = re.match(r"#{1,6}\s+(.*)", line)
        if heading:
            name = base = slug(heading.group(1))
            n = 0
            while name in found:
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` whose file or heading does not exist."""
    broken = []
    for link in relative_links(page.read_text()):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(link)
        elif anchor and target.suffix == ".md" and anchor not in anchors(target.read_text()):
            broken.append(link)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "other.md").write_text(
        "# Other page\n\n## A `code` heading, twice\n\n## A `code` heading, twice\n"
    )
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md) [ok](other.md#other-page) [ok](other.md#a-code-heading-twice-1) [ok](#mine)\n"
        "[gone](missing.md) [gone](other.md#nowhere) [gone](#not-here) [url](https://example.com/x.md)\n"
        "`[code](not-a-link.md)`\n```\n[block](not-a-link-either.md)\n```\n## Mine\n"
    )
    assert broken_links(page) == ["missing.md", "other.md#nowhere", "#not-here"]


def test_the_readme_keeps_the_quick_start_and_test_commands_and_its_size():
    text = README.read_text()
    for command in (*QUICK_START, TEST_COMMAND):
        assert command in text
    assert len(README.read_bytes()) <= README_LIMIT


def test_ci_runs_the_readmes_test_command():
    assert (ROOT / ".ci" / "run").read_text().strip().endswith(TEST_COMMAND)


@pytest.mark.parametrize("folder", ["docs", "benchmarks"])
def test_no_file_of_docs_or_benchmarks_is_over_16_kb(folder):
    large = [str(p) for p in (ROOT / folder).rglob("*") if p.is_file() and p.stat().st_size > PAGE_LIMIT]
    assert large == []


def test_the_docs_state_no_measured_gpu_figure():
    """Measured figures live under benchmarks/, which names the device of each: a docs page that names a
    GPU model is stating one."""
    pages = [p for p in (ROOT / "docs").rglob("*.md") if re.search(r"\b[HAB]\d00\b", p.read_text())]
    assert pages == []


def test_the_readmes_real_run_is_the_config_file():
    block = re.search(r"```yaml\n(.*?)```", README.read_text(), re.DOTALL).group(1)
    assert yaml.safe_load(block) == yaml.safe_load((ROOT / "configs/qwen2.5-vl-7b-video-r1.yaml").read_text())


def test_the_prose_cites_no_internal_reference():
    """Facts are cited by their public sources; a file outside the repository is never named."""
    name = "formats" + ".md"
    files = [*PAGES, *(ROOT / "benchmarks").rglob("*.*"), ROOT / "configs/qwen2.5-vl-7b-video-r1.yaml"]
    assert [str(p) for p in files if name in p.read_text()] == []
