"""benchmarks/results/ holds raw logs that documents cite, nothing else: every file there is
linked from a document (any *.md of the repository), and README.md stays a user's page
(at most 200 lines, at most 8 result rows, each linking its log)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "benchmarks" / "results"
MAX_README_LINES = 200
MAX_RESULT_ROWS = 8
# A markdown link's target, without its #fragment; inline links only, as the docs write them.
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def documents() -> list[Path]:
    """Every *.md of the repository that git knows (tracked or not ignored)."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()
    return [ROOT / p for p in out if (ROOT / p).is_file()]


def link_targets(doc: Path, text: str | None = None) -> set[Path]:
    """The local files a document (or `text` of it) links, resolved from its folder."""
    text = doc.read_text(encoding="utf-8") if text is None else text
    return {
        (doc.parent / target).resolve()
        for target in _LINK.findall(text)
        if "://" not in target and not target.startswith("mailto:")
    }


def results_section(readme: str) -> list[str]:
    """The lines of README.md's `## Results` section."""
    lines = readme.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "## Results")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start + 1:end]


def table_rows(lines: list[str]) -> list[str]:
    """A section's markdown table rows, header and separator left out."""
    rows = [line for line in lines if line.startswith("|")]
    return [row for row in rows[2:] if not re.fullmatch(r"\|[\s|:-]+\|", row)]


def test_every_results_file_is_linked_from_a_document() -> None:
    linked: set[Path] = set()
    for doc in documents():
        linked |= link_targets(doc)
    files = sorted(p for p in RESULTS.rglob("*") if p.is_file())
    assert files, "benchmarks/results/ is empty"
    unlinked = [str(p.relative_to(ROOT)) for p in files if p.resolve() not in linked]
    assert not unlinked, "linked from no *.md (link it where its figure is quoted, or delete it):\n" + "\n".join(unlinked)


def test_results_holds_logs_only() -> None:
    scripts = [p.name for p in RESULTS.rglob("*") if p.suffix in (".sh", ".py")]
    assert not scripts, f"scripts belong in scripts/ or benchmarks/, not results/: {scripts}"


def test_every_link_into_results_names_a_file_there() -> None:
    broken = [
        f"{doc.relative_to(ROOT)} -> {target}"
        for doc in documents()
        for target in link_targets(doc)
        if RESULTS in target.parents and not target.is_file()
    ]
    assert not broken, "links to logs that are not in benchmarks/results/:\n" + "\n".join(broken)


def test_readme_is_a_short_page_with_a_few_headline_results() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= MAX_README_LINES
    rows = table_rows(results_section(readme))
    assert 1 <= len(rows) <= MAX_RESULT_ROWS, f"{len(rows)} result rows"
    readme_path = ROOT / "README.md"
    for row in rows:
        targets = link_targets(readme_path, row)
        assert any(RESULTS in t.parents for t in targets), f"a result row without its log: {row[:80]}"


def test_the_row_counter_skips_header_and_separator() -> None:
    section = ["intro", "| a | b |", "|---|---|", "| 1 | [x](benchmarks/results/x.txt) |", "", "after"]
    assert table_rows(section) == ["| 1 | [x](benchmarks/results/x.txt) |"]
