"""The reading order (docs/course.md, and README's short form), checked against the code, in
its two parts.

- The course (docs/course.md's "The files, in reading order"): every module at the top of picotron/, every file of the
  four axis folders, and train.py, each listed once, in an order where no file imports one
  listed after it, so a student who reads top to bottom has always met what the file in front
  of them uses; its total length is printed, and kept under COURSE_MAX_LINES.
- The wings (the wings' lists of docs/course.md and README): every other folder of picotron/
  is a wing that both point at, and whose `__init__.py` docstring lists every file (and sub-wing) of its folder
  once, again in an order where no file imports one listed after it."""
import ast
import os
import re

from test_repo_rules import ROOT, imports_of, package_modules, package_resolver

AXES = ("tensor_parallel", "pipeline_parallel", "context_parallel", "data_parallel")
COURSE_MAX_LINES = 4500


COURSE_PAGE = os.path.join("docs", "course.md")


def page_section(page: str, heading: str) -> str:
    """The text under `heading` (any level) of a markdown page, up to the next heading."""
    text = open(os.path.join(ROOT, page), encoding="utf-8").read()
    body = re.split(rf"\n#+ {re.escape(heading)}\n", text, maxsplit=1)
    assert len(body) == 2, f"{page} has no heading '{heading}'"
    return body[1].split("\n#", 1)[0]


def course_order() -> list:
    """The files the course's numbered list names, in order. A bare file name is resolved in
    the folder named last before it (`tensor_parallel/` then `layers.py`), else in picotron/."""
    section = page_section(COURSE_PAGE, "The files, in reading order")
    section = section[section.index("\n1. "):]          # the numbered list, not its preface
    files, folder = [], None
    for token in re.findall(r"`([^`]+)`", section):
        if token.endswith("/"):
            folder = token.removeprefix("picotron/").rstrip("/")
            continue
        if not token.endswith(".py") or token == "__init__.py":
            continue         # "each folder's `__init__.py`": no file in particular
        candidates = ([token] if "/" in token or token == "train.py" else
                      [f"picotron/{folder}/{token}"] * bool(folder) + [f"picotron/{token}"])
        found = [c for c in candidates if os.path.exists(os.path.join(ROOT, c))]
        assert found, f"{COURSE_PAGE} names `{token}`, which is not in the repository"
        files.append(found[0])
    return files


def course_files() -> set:
    """What the course must list: picotron/'s top-level modules, the axes' files but their
    `__init__.py` (which only name what the folder exports), and train.py."""
    files = {"train.py"}
    for path in package_modules().values():
        parts = path.split("/")
        if len(parts) == 2 or (len(parts) == 3 and parts[1] in AXES
                               and parts[2] != "__init__.py"):
            files.add(path)
    return files


def wings() -> list:
    """The folders of picotron/ that are not axes, sub-wings (speed/fp8/) included."""
    found = set()
    for path in package_modules().values():
        folder = os.path.dirname(path)
        while folder != "picotron" and folder.split("/")[1] not in AXES:
            found.add(folder)
            folder = os.path.dirname(folder)
    return sorted(found)


def wing_order(wing: str) -> list:
    """The entries the wing's `__init__.py` docstring lists under "Reading order", as paths:
    the indented lines' first words (`sections.py`, `kernels/`)."""
    init = os.path.join(wing, "__init__.py")
    doc = ast.get_docstring(ast.parse(open(os.path.join(ROOT, init), encoding="utf-8").read()))
    assert doc and "Reading order" in doc, f"{init}: its docstring has no reading order"
    listing = doc.split("Reading order", 1)[1]
    names = re.findall(r"^    (\S+\.py|\S+/)(?:\s|$)", listing, re.M)
    return [os.path.join(wing, name.rstrip("/")) for name in names]


def late_imports(listed: list) -> list:
    """`file:line imports X, listed after it` for every import of a listed file that a later
    entry holds (an entry that is a folder holds every module under it)."""
    modules = package_modules()
    resolve = package_resolver(modules)
    position = {f: i for i, f in enumerate(listed)}

    def entry_of(path):
        while path and path not in position:
            path = os.path.dirname(path)
        return path or None
    late = []
    for f in listed:
        for file in ([f] if f.endswith(".py") else
                     [p for p in modules.values() if p.startswith(f + "/")]):
            for line, module in imports_of(file, resolve):
                needed = entry_of(modules.get(module, ""))
                if needed in position and position[needed] > position[f]:
                    late.append(f"{file}:{line} imports {modules[module]}, listed after {f}")
    return list(dict.fromkeys(late))


def test_the_course_lists_every_file_once_in_order():
    listed = course_order()
    repeated = sorted({f for f in listed if listed.count(f) > 1})
    assert not repeated, f"listed more than once: {repeated}"
    expected = course_files()
    assert not expected - set(listed), f"The course leaves out {sorted(expected - set(listed))}"
    assert not set(listed) - expected, (f"The course lists files of the wings: "
                                        f"{sorted(set(listed) - expected)}")
    late = late_imports(listed)
    assert not late, "\n".join(late)


def test_the_course_stays_short(capsys):
    lines = sum(1 for f in course_files() for _ in open(os.path.join(ROOT, f), encoding="utf-8"))
    with capsys.disabled():
        print(f"\nthe course: {len(course_files())} files, {lines} lines")
    assert lines <= COURSE_MAX_LINES, (
        f"the course is {lines} lines, over {COURSE_MAX_LINES}: move what a training step does "
        f"not need into the wing it serves")
    for page, heading in ((COURSE_PAGE, "The files, in reading order"),
                          ("README.md", "The course")):
        quoted = re.search(r"About ([\d,]+) lines", page_section(page, heading))
        assert quoted, f"{page}'s course does not say its length"
        said = int(quoted.group(1).replace(",", ""))
        assert abs(said - lines) <= 0.05 * lines, f"{page} says about {said} lines; it is {lines}"


def test_each_wing_lists_its_files_in_order():
    modules = package_modules()
    lists = {page: page_section(page, "The wings") for page in (COURSE_PAGE, "README.md")}
    problems = []
    for wing in wings():
        for page, listed in lists.items():
            if wing.count("/") == 1 and not re.search(rf"\]\((\.\./)?{wing}/__init__\.py\)",
                                                      listed):
                problems.append(f"{page}'s wings do not point at {wing}/__init__.py")
        listed = wing_order(wing)
        present = {os.path.join(wing, os.path.basename(p)) for p in modules.values()
                   if os.path.dirname(p) == wing and not p.endswith("__init__.py")}
        present |= {w for w in wings() if os.path.dirname(w) == wing}
        # a wing whose __init__.py holds code (speed's apply_speed) lists itself last
        init = os.path.join(wing, "__init__.py")
        if init in listed:
            present.add(init)
        repeated = sorted({f for f in listed if listed.count(f) > 1})
        problems += [f"{wing}: lists {f} more than once" for f in repeated]
        problems += [f"{wing}/__init__.py leaves out {f}" for f in sorted(present - set(listed))]
        problems += [f"{wing}/__init__.py lists {f}, which is not there"
                     for f in sorted(set(listed) - present)]
        problems += late_imports([f for f in listed if f != init])
    assert not problems, "\n".join(problems)
