"""The suite writes gigabytes of runs and checkpoints; what it leaves behind after a session
must be only what a person would read: the folders of the tests that failed."""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TWO_TESTS = textwrap.dedent("""
    def test_passes(tmp_path):
        (tmp_path / "checkpoint.bin").write_bytes(bytes(1 << 20))

    def test_fails(tmp_path):
        (tmp_path / "checkpoint.bin").write_bytes(bytes(1 << 20))
        assert False, "planted"
""")


def _files_under(root) -> list:
    return sorted(os.path.relpath(os.path.join(d, f), root)
                  for d, _, files in os.walk(root) for f in files)


def _session(folder, test_file) -> subprocess.CompletedProcess:
    """One pytest session of `test_file` under the project's pytest.ini, its temporary folders
    under folder/temp_root."""
    (folder / "temp_root").mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-c", os.path.join(ROOT, "pytest.ini"), "--rootdir", str(folder),
                           str(test_file)],
                          env=dict(os.environ, PYTEST_DEBUG_TEMPROOT=str(folder / "temp_root")),
                          capture_output=True, text=True, timeout=120)


def test_a_session_keeps_only_the_failed_tests_folders(tmp_path):
    """Two sessions, each with one passing and one failing test that write 1 MB: what remains
    is the failing test's file of the last session only."""
    (tmp_path / "test_two.py").write_text(TWO_TESTS)
    for _ in range(2):
        done = _session(tmp_path, tmp_path / "test_two.py")
        assert done.returncode == 1 and "1 failed, 1 passed" in done.stdout, done.stdout
    left = _files_under(tmp_path / "temp_root")
    assert len(left) == 1 and left[0].endswith(os.path.join("test_fails0", "checkpoint.bin")), \
        left


def test_a_passing_session_leaves_nothing(tmp_path):
    (tmp_path / "test_one.py").write_text(TWO_TESTS.split("def test_fails")[0])
    done = _session(tmp_path, tmp_path / "test_one.py")
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout
    assert _files_under(tmp_path / "temp_root") == []
