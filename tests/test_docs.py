"""The project documents itself: every link in the README and docs/ leads to a file of
the repository (and a `#section` to one of its headings), none out of it."""

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: pathlib.Path) -> set[str]:
  """The `#...` names of a page's headings, as GitHub makes them."""
  out = set()
  for line in page.read_text().splitlines():
    if line.startswith("#"):
      title = line.lstrip("#").strip().lower()
      out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
  return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_stay_in_the_repository_and_lead_somewhere(page):
  text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # (code is not links)
  links = LINK.findall(text)
  for link in links:
    assert not re.match(r"[a-z]+:", link), f"{page.name}: {link} leads out of the repository"
    path, _, section = link.partition("#")
    target = (page.parent / path).resolve() if path else page
    assert target.is_file() and REPO in target.parents, f"{page.name}: {link} leads nowhere"
    if section:
      assert section in anchors(target), f"{page.name}: {link}: no such heading"
  if page.name == "README.md":  # (each page of docs/ is reached from the README)
    reached = {(page.parent / link.partition("#")[0]).resolve() for link in links}
    assert set(PAGES[1:]) <= reached
