"""README's reading order, checked against the code: it lists every Python file of picotron/
(and train.py) exactly once, in an order where no file imports one that comes later, so a
student who reads top to bottom has always met what the file in front of them uses."""
import os
import re

from test_repo_rules import ROOT, imports_of, package_modules, package_resolver


def reading_order() -> list:
    """The files README's "Reading order" list names, in order. A bare file name is resolved in the
    folder named last before it (`tensor_parallel/` then `layers.py`), else in picotron/."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("## Reading order", 1)[1].split("\n## ", 1)[0]
    section = section[section.index("\n1. "):]          # the numbered list, not its preface
    files, folder = [], None
    for token in re.findall(r"`([^`]+)`", section):
        if token.endswith("/"):
            folder = token.removeprefix("picotron/").rstrip("/")
            continue
        if not token.endswith(".py") or (token == "__init__.py" and folder is None):
            continue         # "each folder's `__init__.py`": no file in particular
        candidates = ([token] if "/" in token or token == "train.py" else
                      [f"picotron/{folder}/{token}"] * bool(folder) + [f"picotron/{token}"])
        found = [c for c in candidates if os.path.exists(os.path.join(ROOT, c))]
        assert found, f"README's reading order names `{token}`, which is not in the repository"
        files.append(found[0])
    return files


def test_reading_order_lists_every_file_once():
    listed = reading_order()
    modules = package_modules()
    expected = set(modules.values()) | {"train.py"}
    repeated = sorted({f for f in listed if listed.count(f) > 1})
    assert not repeated, f"listed more than once: {repeated}"
    missing = sorted(f for f in expected - set(listed)
                     if not (f.endswith("__init__.py") and f != "picotron/speed/__init__.py"))
    assert not missing, f"README's reading order leaves out {missing}"


def test_no_file_needs_one_that_comes_later():
    listed = reading_order()
    modules = package_modules()
    file_of = dict(modules)
    resolve = package_resolver(modules)
    position = {f: i for i, f in enumerate(listed)}
    late = []
    for f in listed:
        for line, module in imports_of(f, resolve):
            needed = file_of.get(module)
            if needed in position and position[needed] > position[f]:
                late.append(f"{f}:{line} imports {needed}, listed after it")
    assert not late, "\n".join(late)
