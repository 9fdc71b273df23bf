"""Run scripts one after another as `python SCRIPT --help` runs each, in one interpreter, and
print one line per script, "HELP " then JSON: its exit code, stdout, stderr, and the options
of the first parser it asks to parse, with their help texts.

    python tests/workers/show_help.py SCRIPT [SCRIPT ...]

As Python does for `python SCRIPT`, the script's own folder comes first on sys.path, and the
repository root is not on it, so a bench script that forgets to put the root there cannot
import picotron here either. Before each script every module of the repository is forgotten
(torch and the other packages stay loaded: what makes one interpreter faster than one per
script), so each script imports ours afresh through its own sys.path."""
import argparse
import contextlib
import io
import json
import os
import runpy
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OTHER_PATHS = [p for p in sys.path[1:] if os.path.abspath(p or ".") != ROOT]
# parse_args calls parse_known_args, which our scripts' parse_flags calls directly
parse_known_args = argparse.ArgumentParser.parse_known_args
parsers = []


def record_options_then_parse(parser, args=None, namespace=None):
    parsers.append([{"option": "/".join(a.option_strings) or a.dest, "help": a.help}
                    for a in parser._actions if not isinstance(a, argparse._HelpAction)])
    return parse_known_args(parser, args, namespace)


def ours(module) -> bool:
    path = getattr(module, "__file__", None)
    return bool(path) and os.path.abspath(path).startswith(ROOT + os.sep)


def run_help(script: str) -> dict:
    for name in [n for n, m in sys.modules.items() if n != "__main__" and ours(m)]:
        del sys.modules[name]
    sys.path[:] = [os.path.dirname(script)] + OTHER_PATHS
    sys.argv = [script, "--help"]
    parsers.clear()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
            code = "returned without exiting: --help was never parsed"
        except SystemExit as e:
            code = e.code or 0
        except BaseException:
            traceback.print_exc()
            code = 1
    return {"script": script, "code": code, "stdout": out.getvalue(), "stderr": err.getvalue(),
            "options": parsers[0] if parsers else None}


argparse.ArgumentParser.parse_known_args = record_options_then_parse
for path in sys.argv[1:]:
    print("HELP " + json.dumps(run_help(os.path.abspath(path))), flush=True)
