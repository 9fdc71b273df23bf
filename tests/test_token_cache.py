"""The token cache shared by runs: a second run on the same data and tokenizer loads neither;
a changed file or tokenizer is a new entry; a damaged entry is found and rebuilt; a cache
others share is readable by them, and one this user cannot write still serves its entries."""
import json
import os

import pytest

import picotron.config.ranges as config_ranges
import picotron.data.tokenized as tokenized_data
from tiny import documents, tiny_tokenizer
from picotron.data import token_cache
from picotron.config import Config
from picotron.errors import DataError
from picotron.utils import UMASK


class Calls:
    """Counts the calls that a cache hit must not make: loading the tokenizer, the documents."""

    def __init__(self, monkeypatch):
        self.tokenizer = self.documents = 0
        real_tokenizer = tokenized_data.load_tokenizer
        real_documents = tokenized_data.load_documents

        def load_tokenizer(source):
            self.tokenizer += 1
            return real_tokenizer(source)

        def load_documents(d, split):
            self.documents += 1
            return real_documents(d, split)
        monkeypatch.setattr(tokenized_data, "load_tokenizer", load_tokenizer)
        monkeypatch.setattr(tokenized_data, "load_documents", load_documents)

    def reset(self):
        self.tokenizer = self.documents = 0


def write_jsonl(path, docs):
    with open(path, "w") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


def config_for(source, tokenizer, cache_dir=None) -> Config:
    c = Config()
    c.dataset.name, c.dataset.tokenizer, c.dataset.cache_dir = source, tokenizer, cache_dir
    c.model.vocab_size = 300
    return c


def tokens(config, run_dir):
    return tokenized_data.dataset_tokens(config, "train", str(run_dir))[0].tolist()


def entries(root) -> list:
    return sorted(f for f in os.listdir(root) if not f.startswith("."))


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_two_run_dirs_share_one_tokenization(tmp_path, monkeypatch, tokenizer):
    calls = Calls(monkeypatch)
    docs = documents(30)
    source = write_jsonl(tmp_path / "docs.jsonl", docs)
    if tokenizer == "bpe":
        tokenizer = tiny_tokenizer(str(tmp_path / "tok"), docs)
    first = tokens(config_for(source, tokenizer), tmp_path / "run_a")
    assert (calls.tokenizer, calls.documents) == (1, 1)
    root = token_cache.default_cache_dir()       # the tests' XDG_CACHE_HOME (conftest.py)
    assert root.startswith(os.environ["XDG_CACHE_HOME"]) and len(entries(root)) >= 2
    calls.reset()
    second = tokens(config_for(source, tokenizer), tmp_path / "run_b")
    assert second == first and (calls.tokenizer, calls.documents) == (0, 0)
    assert not os.path.exists(tmp_path / "run_a") and not os.path.exists(tmp_path / "run_b")


def test_a_changed_file_or_tokenizer_is_a_new_entry(tmp_path, monkeypatch):
    calls = Calls(monkeypatch)
    docs = documents(30)
    source = write_jsonl(tmp_path / "docs.jsonl", docs)
    tok = tiny_tokenizer(str(tmp_path / "tok"), docs)
    config = config_for(source, tok, cache_dir="cache")        # relative: from the run dir
    before = tokens(config, tmp_path)
    assert len(entries(tmp_path / "cache")) == 2               # <key>.npy and <key>.json
    calls.reset()
    write_jsonl(source, docs[:20])                             # same path, other content
    fewer = tokens(config, tmp_path)
    assert calls.documents == 1 and len(fewer) < len(before)
    calls.reset()
    tiny_tokenizer(tok, docs, vocab_size=60)                   # same path, other vocabulary
    other = tokens(config, tmp_path)
    assert calls.tokenizer == 1 and other != fewer
    assert len(entries(tmp_path / "cache")) == 6
    calls.reset()
    assert tokens(config_for(source, "byte", "cache"), tmp_path) == \
        [b for d in docs[:20] for b in list(d.encode()) + [0]]
    assert calls.tokenizer == 1                                # byte-level: a new entry too


def test_a_damaged_entry_is_detected_and_rebuilt(tmp_path, monkeypatch, capsys):
    calls = Calls(monkeypatch)
    source = write_jsonl(tmp_path / "docs.jsonl", documents(30))
    config = config_for(source, "byte", str(tmp_path / "cache"))
    good = tokens(config, tmp_path)
    npy = [os.path.join(tmp_path, "cache", f) for f in entries(tmp_path / "cache")
           if f.endswith(".npy")][0]
    size = os.path.getsize(npy)

    def damage_and_reload(how) -> str:
        how()
        calls.reset()
        capsys.readouterr()
        assert tokens(config, tmp_path) == good, how
        assert calls.documents == 1                            # tokenized again
        assert os.path.getsize(npy) == size                    # and whole again
        return capsys.readouterr().out

    def truncate():
        with open(npy, "r+b") as f:
            f.truncate(size - 7)

    def flip_a_byte():
        with open(npy, "r+b") as f:
            f.seek(size - 3)
            byte = f.read(1)
            f.seek(size - 3)
            f.write(bytes([byte[0] ^ 0x55]))

    def garbage_header():
        with open(npy, "r+b") as f:
            f.write(b"not an npy file")

    assert "damaged (ValueError" in damage_and_reload(truncate)
    assert "its sha256 differs" in damage_and_reload(flip_a_byte)
    assert "damaged (ValueError" in damage_and_reload(garbage_header)
    damage_and_reload(lambda: os.remove(npy[:-4] + ".json"))  # not complete: not there yet
    calls.reset()
    assert tokens(config, tmp_path) == good and calls.documents == 0
    # the temporary files of a writer that died are removed a day later, a live one's kept
    dead, live = tmp_path / "cache" / ".tmp-dead.npy", tmp_path / "cache" / ".tmp-live.npy"
    dead.write_bytes(b"half")
    live.write_bytes(b"half")
    os.utime(dead, (0, os.path.getmtime(dead) - 2 * 86400))
    os.remove(npy[:-4] + ".json")
    tokens(config, tmp_path)
    assert not dead.exists() and live.exists()


def test_hub_data_and_tokenizer_are_keyed_by_their_local_snapshot(tmp_path, monkeypatch):
    """A hub dataset and tokenizer not downloaded yet are loaded (which downloads them), then
    keyed by the commit and files of their snapshot in the Hugging Face cache; the next run
    finds the entry without loading either, and a newer snapshot is a new entry."""
    import dataclasses
    import shutil
    from huggingface_hub import constants
    hub = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    docs = documents(30)
    local = write_jsonl(tmp_path / "docs.jsonl", docs)
    tok = tiny_tokenizer(str(tmp_path / "tok"), docs)
    real_tokenizer, real_documents = tokenized_data.load_tokenizer, tokenized_data.load_documents
    loads = []

    def download(kind, repo, commit, files=None):   # what the hub client leaves in its cache
        folder = hub / f"{kind}s--{repo.replace('/', '--')}"
        os.makedirs(folder / "refs", exist_ok=True)
        (folder / "refs" / "main").write_text(commit)
        if files:
            shutil.copytree(files, folder / "snapshots" / commit, dirs_exist_ok=True)

    def load_tokenizer(source):
        loads.append("tokenizer")
        download("model", source, "t1", tok)
        return real_tokenizer(tok)

    def load_documents(d, split):
        loads.append("documents")
        download("dataset", d.name, "d1")
        return real_documents(dataclasses.replace(d, name=local), split)
    monkeypatch.setattr(tokenized_data, "load_tokenizer", load_tokenizer)
    monkeypatch.setattr(tokenized_data, "load_documents", load_documents)
    config = config_for("someone/corpus", "someone/tok", str(tmp_path / "cache"))
    assert token_cache.data_fingerprint("someone/corpus") is None     # never downloaded
    first = tokens(config, tmp_path)
    assert loads == ["tokenizer", "documents"]
    assert token_cache.data_fingerprint("someone/corpus") == "hub:someone/corpus@d1"
    assert tokens(config, tmp_path) == first and len(loads) == 2      # a hit, nothing loaded
    download("dataset", "someone/corpus", "d2")                        # a newer snapshot:
    assert tokens(config, tmp_path) == first                           # tokenized again
    assert loads[2:] == ["tokenizer", "documents"]
    assert len(entries(tmp_path / "cache")) == 4


def test_two_runs_tokenizing_at_once_leave_one_whole_entry(tmp_path):
    """Both write their own temporary files and rename them: each run gets the whole stream,
    the cache holds one entry and no temporary file."""
    import subprocess
    import sys
    from launch import ROOT
    docs = documents(3000)
    source = write_jsonl(tmp_path / "docs.jsonl", docs)
    script = ("import sys; from picotron.config import Config; "
              "from picotron.data.tokenized import dataset_tokens; c = Config(); "
              "c.dataset.name, c.dataset.tokenizer, c.dataset.cache_dir = sys.argv[1:4]; "
              "print('TOKENS', len(dataset_tokens(c, 'train', None)[0]))")
    args = [sys.executable, "-c", script, source, "byte", str(tmp_path / "cache")]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    runs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env, cwd=ROOT) for _ in range(2)]
    outs = [r.communicate(timeout=300) for r in runs]
    assert all(r.returncode == 0 for r in runs), [err[-2000:] for _, err in outs]
    expected = sum(len(d.encode()) + 1 for d in docs)
    assert all(f"TOKENS {expected}" in out for out, _ in outs)
    assert len(os.listdir(tmp_path / "cache")) == 2             # <key>.npy, <key>.json
    key = entries(tmp_path / "cache")[0][:-len(".json")]
    assert token_cache.lookup(str(tmp_path / "cache"), key) is not None


def test_the_cache_is_trimmed_to_its_cap_least_recently_used_first(tmp_path, capsys):
    """dataset.cache_max_gb: writing a fourth entry past the cap removes the least recently
    used ones (a hit counts as a use), never the one just written nor one used within the
    grace period; each run still gets its tokens (a removed entry is tokenized again)."""
    root = tmp_path / "cache"
    sources = [write_jsonl(tmp_path / f"docs{i}.jsonl", documents(40 + i)) for i in range(4)]

    def run(i, cap_gb):
        c = config_for(sources[i], "byte", str(root))
        c.dataset.cache_max_gb = cap_gb
        return tokens(c, tmp_path)

    first = [run(i, 0) for i in range(3)]                       # no cap: three entries
    keys = [e[:-len(".json")] for e in entries(root) if e.endswith(".json")]
    assert len(keys) == 3
    sizes = {k: os.path.getsize(root / f"{k}.npy") + os.path.getsize(root / f"{k}.json")
             for k in keys}
    by_source = {}
    for k in keys:
        with open(root / f"{k}.json") as f:
            by_source[json.load(f)["source"]] = k
    order = [by_source[s] for s in sources[:3]]
    for age, k in zip((300, 200, 100), order):      # entry 0 used longest ago, then 1, then 2
        used = os.path.getmtime(root / f"{k}.json") - 7200 - age
        os.utime(root / f"{k}.json", (used, used))
    assert run(0, 0) == first[0]                    # a hit: entry 0 is now the most recent
    # room for entries 0 and 2 and the new one (a little larger than any, 43 documents), not
    # for entry 1 too: entry 1, the least recently used, must go
    cap = (sizes[order[0]] + sizes[order[2]] + 1.5 * max(sizes.values())) / 1e9
    run(3, cap)
    left = {e[:-len(".json")] for e in entries(root) if e.endswith(".json")}
    assert order[1] not in left and {order[0], order[2]} <= left and len(left) == 3, left
    assert not (root / f"{order[1]}.npy").exists()
    assert "removed 1 least recently used entries" in capsys.readouterr().out
    # a cap nothing can meet: entries used within the hour stay, and it says so
    assert run(1, 1e-9) == first[1]                 # tokenized again, then trimmed
    left = {e[:-len(".json")] for e in entries(root) if e.endswith(".json")}
    assert order[1] in left
    out = capsys.readouterr().out
    assert "over dataset.cache_max_gb" in out


def test_a_read_only_cache_serves_its_entries_and_refuses_a_miss_before_tokenizing(
        tmp_path, monkeypatch):
    """A cache another user filled: its entries read as usual (mode 0666 less the umask, not
    mkstemp's 0600, so that they can be); a miss there is refused before the tokenizing,
    naming dataset.cache_dir, instead of failing at the write after it."""
    calls = Calls(monkeypatch)
    source = write_jsonl(tmp_path / "docs.jsonl", documents(20))
    shared = str(tmp_path / "shared")
    first = tokens(config_for(source, "byte", shared), tmp_path / "run")
    for name in entries(shared):
        assert os.stat(os.path.join(shared, name)).st_mode & 0o777 == 0o666 & ~UMASK, name
    real = os.access        # root writes anywhere: the read-only folder is played by os.access
    monkeypatch.setattr(config_ranges.os, "access",
                        lambda p, mode: False if p == shared else real(p, mode))
    calls.reset()
    assert tokens(config_for(source, "byte", shared), tmp_path / "run") == first
    other = write_jsonl(tmp_path / "other.jsonl", documents(5))
    with pytest.raises(DataError, match="no usable entry in the token cache, and the cache "
                                        ".*shared' cannot be written: .*set dataset.cache_dir"):
        tokens(config_for(other, "byte", shared), tmp_path / "run")
    assert calls.documents == 0
