"""The repository's house rules, checked on every file:
- every Python file stays under 300 lines, so a student can read a module in one sitting;
- imports point one way, up the layers of LAYERS below, with no cycles, and model.py stays
  the plain model (torch only, no fast path named);
- the repository stands alone: no file cites the team's pages, an issue number, or (in code)
  a session of the measurement diary, which lives in bench/NOTES.md."""
import ast
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The package's layers, lowest first, by folder: a module may import modules of its own layer
# or lower. A name covers the module or folder and everything below it; every module of the
# package must fall under one (a new file goes into the wing it serves). The top of picotron/
# holds the base and the course (grid, model, loss, the four axes); the wings come after them,
# and speed/ last: nothing below it knows the fast paths exist.
LAYERS = [
    ("base", ["picotron.errors", "picotron.utils", "picotron.comm"]),
    ("config", ["picotron.config"]),
    ("grid", ["picotron.process_group_manager"]),
    ("model", ["picotron.attention", "picotron.model", "picotron.loss"]),
    ("axes", ["picotron.tensor_parallel", "picotron.pipeline_parallel",
              "picotron.context_parallel", "picotron.data_parallel"]),
    ("data", ["picotron.data"]),
    ("checkpoint", ["picotron.checkpoint"]),
    ("plan", ["picotron.plan"]),
    ("run", ["picotron.run"]),
    ("speed.kernels", ["picotron.speed.kernels"]),
    ("speed.fp8", ["picotron.speed.fp8"]),
    ("speed", ["picotron.speed"]),
]
# model.py is the readable reference the fast paths are tested against: it imports only these
# (and the standard library), and never names a fast path.
MODEL_IMPORTS = ("torch", "picotron.config", "picotron.attention")
MODEL_BANNED = ("kernels", "triton", "liger", "checkpoint", "cuda_graph", "fused", "head=")
SCRIPTS = ("train.py", "create_config.py", "generate.py", "export_hf.py", "plot.py")


def repo_files():
    """The tracked files and the new ones git does not ignore; outside a git checkout, every
    file not under a dot dir."""
    listing = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, text=True)
    if listing.returncode == 0 and listing.stdout.strip():
        files = listing.stdout.splitlines()
    else:
        files = [os.path.relpath(os.path.join(d, f), ROOT) for d, dirs, names in os.walk(ROOT)
                 if not any(part.startswith(".") for part in
                            os.path.relpath(d, ROOT).split(os.sep) if part != ".")
                 for f in names]
    return sorted(f for f in set(files) if os.path.isfile(os.path.join(ROOT, f)))


def python_files():
    return [f for f in repo_files() if f.endswith(".py")]


def test_every_python_file_is_under_300_lines():
    files = python_files()
    assert len(files) > 20, files                  # the listing worked
    long = {f: n for f in files
            if (n := sum(1 for _ in open(os.path.join(ROOT, f), encoding="utf-8"))) >= 300}
    assert not long, f"files of 300 lines or more (split them): {long}"


def layer_of(module: str):
    """The index in LAYERS of the first entry that covers `module`; None if none does."""
    for i, (_, names) in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    return None


def imports_of(path: str, resolve) -> list:
    """(line, module) for every import in the file, top-level or inside a function. `resolve`
    takes the dotted names an import may mean, most specific first (`from a import b` imports
    the module a.b if there is one, else the name b of module a), and returns the module of
    ours it imports, or None for anything else."""
    found = []
    for node in ast.walk(ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            meanings = [[a.name] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                                   # relative: from its package
                package = os.path.dirname(path).replace(os.sep, ".").split(".")
                base = ".".join(package[:len(package) - node.level + 1] + [base]).strip(".")
            meanings = [[f"{base}.{a.name}", base] for a in node.names]
        else:
            continue
        found += [(node.lineno, m) for m in map(resolve, meanings) if m]
    return found


def package_modules() -> dict:
    """picotron module name -> its file."""
    return {f[:-3].replace("/", ".").removesuffix(".__init__"): f
            for f in python_files() if f.startswith("picotron/")}


def package_resolver(modules):
    """The longest module of ours that the import names; a picotron name that is no module
    here (a renamed one) is kept as written, so its layer still shows."""
    def resolve(meanings):
        if meanings[-1].split(".")[0] != "picotron":
            return None
        parts = meanings[0].split(".")
        prefixes = (".".join(parts[:n]) for n in range(len(parts), 0, -1))
        return next((p for p in prefixes if p in modules), meanings[-1])
    return resolve


def find_cycles(graph: dict) -> list:
    """The shortest cycle through each node that lies on one, each cycle once: [a, b, ..., a].
    (A breadth-first walk from every node: the graphs here have a few dozen nodes.)"""
    cycles = {}
    for start in sorted(graph):
        came_from, frontier = {}, [start]
        while frontier and start not in came_from:
            step = []
            for v in frontier:
                for w in sorted(graph.get(v, ())):
                    if w not in came_from:
                        came_from[w] = v
                        step.append(w)
            frontier = step
        if start in came_from:                 # walk back from start to start
            path = [start]
            while len(path) == 1 or path[-1] != start:
                path.append(came_from[path[-1]])
            cycles.setdefault(frozenset(path), path[::-1])
    return list(cycles.values())


def package_problems() -> list:
    """Upward imports, imports of modules that do not exist, and cycles, inside picotron/."""
    modules = package_modules()
    assert "picotron.model" in modules, modules            # the listing worked
    problems, graph = [], {}
    for module, path in sorted(modules.items()):
        found = imports_of(path, package_resolver(modules))
        graph[module] = {m for _, m in found if m != module}
        if layer_of(module) is None:
            problems.append(f"{path}: {module} is in no layer of LAYERS: move it into the wing "
                            f"it serves (or, for a new wing, add the wing to LAYERS)")
            continue
        problems += [f"{path}:{line}: {module} ({LAYERS[layer_of(module)][0]}) imports {m} "
                     f"({LAYERS[layer_of(m)][0]}), a higher layer"
                     for line, m in found if m in modules and layer_of(m) > layer_of(module)]
        problems += [f"{path}:{line}: {module} imports {m}, which is no module here (renamed?)"
                     for line, m in found if m not in modules]
    return problems + ["import cycle: " + " -> ".join(c) for c in find_cycles(graph)]


def model_problems() -> list:
    """model.py's imports beyond MODEL_IMPORTS and the standard library, and the fast-path
    names it must not know (a plain text search: comments count too)."""
    problems = []
    stdlib = set(sys.stdlib_module_names)
    for line, name in sorted(set(imports_of("picotron/model.py", lambda m: m[-1]))):
        if name.split(".")[0] not in stdlib and not any(
                name == m or name.startswith(m + ".") for m in MODEL_IMPORTS):
            problems.append(f"picotron/model.py:{line}: imports {name}; the model imports "
                            f"only {', '.join(MODEL_IMPORTS)} and the standard library")
    with open(os.path.join(ROOT, "picotron/model.py"), encoding="utf-8") as f:
        for n, text in enumerate(f, 1):
            problems += [f"picotron/model.py:{n}: names '{word}' (fast paths and their "
                         f"switches are applied from outside the model)"
                         for word in MODEL_BANNED if word in text.lower()]
    return problems


def script_cycles() -> list:
    """Cycles among the top-level scripts and bench/'s, which import each other by bare name
    (a bench script looks in bench/ first, then at the root)."""
    scripts = [f for f in python_files()
               if f in SCRIPTS or (f.startswith("bench/") and f.count("/") == 1)]
    graph = {}
    for script in scripts:
        def resolve(meanings, here=os.path.dirname(script)):
            near = [os.path.join(d, m.replace(".", "/") + ".py") for m in meanings
                    for d in dict.fromkeys((here, ""))]
            return next((p for p in near if p in scripts), None)
        graph[script] = {p for _, p in imports_of(script, resolve)} - {script}
    return ["import cycle: " + " -> ".join(c) for c in find_cycles(graph)]


def test_imports_point_one_way():
    problems = package_problems() + model_problems() + script_cycles()
    assert not problems, "imports that do not point one way:\n" + "\n".join(problems)


TEAM_PAGES = re.compile(r"\b(PITFALLS|DESIGN|STYLE|DEVELOPERS)\.md\b", re.IGNORECASE)
ISSUE = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
SESSION = re.compile(r"\bsession #?\d+", re.IGNORECASE)


def test_self_contained_docs():
    """A reader has only the repository: no file cites the team's pages or an issue number,
    and no code cites a session of the measurement diary (its numbers live in
    bench/NOTES.md, the one file allowed all three)."""
    files = repo_files()
    assert "README.md" in files, files[:20]
    problems = []
    for path in files:
        if path == "bench/NOTES.md":
            continue
        try:
            lines = open(os.path.join(ROOT, path), encoding="utf-8").read().splitlines()
        except UnicodeDecodeError:                    # not text
            continue
        rules = [TEAM_PAGES, ISSUE] + ([SESSION] if path.endswith(".py") else [])
        problems += [f"{path}:{n}: {m.group(0)!r}: {text.strip()[:100]}"
                     for n, text in enumerate(lines, 1) for rule in rules
                     for m in rule.finditer(text)]
    assert not problems, ("references a reader of the repository cannot follow (say the fact "
                          "itself; measurements go to bench/NOTES.md):\n" + "\n".join(problems))
