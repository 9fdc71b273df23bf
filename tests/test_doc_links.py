"""The pages hold together: every link in README and docs/ resolves to a file of the
repository or to a heading of the page it names (GitHub's anchors), README stays a front page
(at most 250 lines) and its index names every page of docs/."""
import os
import re

from launch import ROOT

README_MAX_LINES = 250


def pages() -> list:
    docs = os.path.join(ROOT, "docs")
    return ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(docs)
                                  if f.endswith(".md"))


def without_blocks(text: str) -> str:
    """The text with its fenced code blocks blanked (a line starting with # there is a
    comment), each line kept so that line numbers stay the page's."""
    return re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text,
                  flags=re.S | re.M)


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans, where brackets are not links."""
    return re.sub(r"`[^`\n]*`", "", without_blocks(text))


def anchors(text: str) -> set:
    """GitHub's anchor for each heading: lower case, punctuation dropped, spaces to hyphens,
    a repeated heading numbered -1, -2, ..."""
    found, seen = set(), {}
    for heading in re.findall(r"^#+ (.+)$", without_blocks(text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def links(text: str) -> list:
    """(line number, target) of every markdown link and image outside code."""
    out = []
    for number, line in enumerate(prose(text).splitlines(), 1):
        out += [(number, target) for target in re.findall(r"\]\(([^)\s]+)\)", line)]
    return out


def broken_links(root: str, page: str) -> list:
    """`page:line: target (why)` for every link of `page` (relative to `root`) that does not
    resolve. Links to the web are not followed (no network here)."""
    with open(os.path.join(root, page), encoding="utf-8") as f:
        text = f.read()
    broken = []
    for number, target in links(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        where = os.path.normpath(os.path.join(root, os.path.dirname(page), path)) if path \
            else os.path.join(root, page)
        if not os.path.realpath(where).startswith(os.path.realpath(root)):
            broken.append(f"{page}:{number}: {target} (outside the repository)")
        elif not os.path.exists(where):
            broken.append(f"{page}:{number}: {target} (no such file)")
        elif anchor:
            if not where.endswith(".md"):
                broken.append(f"{page}:{number}: {target} (an anchor into a file that is not "
                              f"markdown)")
            elif anchor not in anchors(open(where, encoding="utf-8").read()):
                broken.append(f"{page}:{number}: {target} (no heading #{anchor} there)")
    return broken


def test_every_link_resolves():
    broken = [b for page in pages() for b in broken_links(ROOT, page)]
    assert not broken, "\n".join(broken)


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Its part\n")
    (tmp_path / "README.md").write_text(
        "# Front\n\n[fine](docs/a.md#its-part) [fine](#front) `[code](missing.md)`\n"
        "[gone](docs/b.md) [no heading](docs/a.md#other) [here](#nowhere) [out](../x.md)\n"
        "```\n[in a block](missing.md)\n```\n![picture](docs/images/none.svg)\n")
    assert broken_links(str(tmp_path), "README.md") == [
        "README.md:4: docs/b.md (no such file)",
        "README.md:4: docs/a.md#other (no heading #other there)",
        "README.md:4: #nowhere (no heading #nowhere there)",
        "README.md:4: ../x.md (outside the repository)",
        "README.md:8: docs/images/none.svg (no such file)"]


def test_headings_become_githubs_anchors():
    assert anchors("# What `auto` picks\n## Which layout?\n## Which layout?\n") == {
        "what-auto-picks", "which-layout", "which-layout-1"}


def test_readme_is_a_front_page_that_indexes_docs():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert readme.count("\n") <= README_MAX_LINES, (
        f"README.md has {readme.count(chr(10))} lines, over {README_MAX_LINES}: move the detail "
        f"into the docs/ page it belongs to")
    index = readme.split("\n## Documentation\n", 1)[1]
    missing = [p for p in pages()[1:] if f"]({p})" not in index]
    assert not missing, f"README's documentation index leaves out {missing}"
