"""The house's documents: a README a newcomer reads in one sitting (issue 37: at most 250 lines), a benchmark
results page of at most 400, and links between the documents that lead somewhere (every relative link's file
exists, and its #anchor is one of that file's headings, as GitHub makes them)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", ROOT / "bench" / "README.md", ROOT / "deploy" / "README.md",
             *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings: lower case, punctuation but hyphens dropped, spaces to
    hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    found = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not (heading := re.match(r"#{1,6} (.*)", line)):
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # code blocks hold no links
    return [link for link in LINK.findall(text) if not re.match(r"[a-z]+:", link)]


def test_the_readme_is_at_most_250_lines_and_its_performance_summary_15():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    summary = text.split("## Performance\n", 1)[1].split("\n## ", 1)[0]
    assert sum(1 for line in summary.splitlines() if line.strip()) <= 15  # issue 14


def test_the_benchmark_results_page_is_at_most_400_lines():
    """Issue 37: a results page (today's figures, their commands, what they mean), not a diary; it had grown back
    to 1,096 lines."""
    assert len((ROOT / "bench" / "README.md").read_text().splitlines()) <= 400


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(document):
    broken = []
    for link in relative_links(document):
        target, _, anchor = link.partition("#")
        path = (document.parent / target).resolve() if target else document
        if not path.exists():
            broken.append(f"{link}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{link}: no such heading")
    assert not broken, broken
