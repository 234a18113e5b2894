"""Every relative link in README.md, BENCHMARKS.md and docs/ names a file that exists and, where it names a heading
(`page.md#anchor`), a heading that page has (GitHub's anchors: lower case, punctuation dropped, spaces as dashes,
a repeated heading numbered)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    for line in page.read_text().splitlines():
        heading = re.match(r"#+ (.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def test_relative_links_reach_their_files_and_headings():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_check_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A held-out judge: `--eval-reward`\n")
    assert anchors(page) == {"a-held-out-judge---eval-reward"}
