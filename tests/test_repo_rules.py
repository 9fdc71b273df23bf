"""The developers' guide's rule that every Python file stays under 300 lines (so a student can
read a module in one sitting), checked on every Python file the repository tracks."""
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_python_file_is_under_300_lines():
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    assert len(files) > 20, files                  # the listing worked
    long = {f: n for f in files
            if (n := sum(1 for _ in open(os.path.join(ROOT, f), encoding="utf-8"))) >= 300}
    assert not long, f"files of 300 lines or more (split them): {long}"
