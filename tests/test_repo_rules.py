"""The developers' guide's rule that every Python file stays under 300 lines (so a student can
read a module in one sitting), checked on every Python file of the repository."""
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_files():
    """The tracked .py files; outside a git checkout, every .py file not under a dot dir."""
    listing = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True,
                             text=True)
    if listing.returncode == 0 and listing.stdout.strip():
        return listing.stdout.split()
    return [os.path.relpath(os.path.join(d, f), ROOT) for d, dirs, files in os.walk(ROOT)
            if not any(part.startswith(".") for part in os.path.relpath(d, ROOT).split(os.sep)
                       if part != ".")
            for f in files if f.endswith(".py")]


def test_every_python_file_is_under_300_lines():
    files = python_files()
    assert len(files) > 20, files                  # the listing worked
    long = {f: n for f in files
            if (n := sum(1 for _ in open(os.path.join(ROOT, f), encoding="utf-8"))) >= 300}
    assert not long, f"files of 300 lines or more (split them): {long}"
