"""Importing the package, and every module of it, changes no process state; its modules import one another one way.

The import test runs in a fresh interpreter: a state changed by an earlier test (or by pytest) cannot hide a change,
and what the import changes cannot leak into other tests. The libraries the package imports are imported before the
first look (urllib3, scipy and others add warning filters when imported): what remains is the package's own doing.
"""

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from helpers import REPO

PACKAGE = REPO / "hf_scratch_transformer"

# Runs the libraries' import statements (argv[1], JSON), snapshots every process-wide setting an import could
# change, imports the package and each of its modules (pkgutil.walk_packages), snapshots again and prints what
# differs.
IMPORT_EVERYTHING = textwrap.dedent('''
    import json, logging, os, pkgutil, signal, sys, threading, warnings
    import matplotlib, torch

    for statement in json.loads(sys.argv[1]):
        try:
            exec(statement, {})
        except ImportError:  # an optional dependency that is not installed: the module imports it lazily too
            pass

    def snapshot():
        root = logging.getLogger()
        return {
            "os.environ": dict(os.environ),
            "threading.excepthook": threading.excepthook,
            "sys.excepthook": sys.excepthook,
            "signal handlers": {name: signal.getsignal(getattr(signal, name)) for name in ("SIGINT", "SIGTERM")},
            "root logger level": root.level,
            "root logger handlers": list(root.handlers),
            "logging.disable": logging.root.manager.disable,
            "warnings.filters": list(warnings.filters),
            "matplotlib backend": dict.__getitem__(matplotlib.rcParams, "backend"),  # as set, not resolved
            "torch.get_num_threads()": torch.get_num_threads(),
            "torch float32 matmul precision": torch.get_float32_matmul_precision(),
            "torch deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
            "torch default dtype": torch.get_default_dtype(),
        }

    before = snapshot()
    import hf_scratch_transformer
    modules = [info.name for info in pkgutil.walk_packages(hf_scratch_transformer.__path__, "hf_scratch_transformer.")]
    for name in modules:
        __import__(name)
    after = snapshot()
    changed = {key: [repr(before[key]), repr(after[key])] for key in before if before[key] != after[key]}
    if before["os.environ"] != after["os.environ"]:
        keys = set(before["os.environ"]) | set(after["os.environ"])
        changed["os.environ"] = {key: [before["os.environ"].get(key), after["os.environ"].get(key)]
                                 for key in sorted(keys) if before["os.environ"].get(key) != after["os.environ"].get(key)}
    print(json.dumps({"modules": modules, "changed": changed}))
''')


def test_importing_the_package_and_every_module_changes_no_process_state():
    # a variable the package might set must not be set already (setdefault would then hide the change)
    env = {key: value for key, value in os.environ.items() if key not in ("MKL_CBWR", "MPLBACKEND")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", IMPORT_EVERYTHING, json.dumps(library_imports(PACKAGE))],
                            capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    # every module was imported, from the copy under test
    assert {"hf_scratch_transformer.plotting", "hf_scratch_transformer.training.run",
            "hf_scratch_transformer.translation.cli", "hf_scratch_transformer.export.ct2",
            "hf_scratch_transformer.translation.demo"} <= set(report["modules"])
    assert report["changed"] == {}


def library_imports(package: Path) -> list[str]:
    """The import statements of other libraries that the modules of `package` run when imported (at module level,
    also inside a top-level `try` or `if`), as source lines."""
    statements = set()
    for path in package.rglob("*.py"):
        todo = list(ast.parse(path.read_text(encoding="utf-8")).body)
        while todo:
            node = todo.pop()
            if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and not node.level):
                if not ast.unparse(node).split()[1].startswith(package.name):
                    statements.add(ast.unparse(node))
            elif isinstance(node, (ast.Try, ast.If)):
                todo += node.body + node.orelse + [item for handler in getattr(node, "handlers", [])
                                                   for item in handler.body]
    return sorted(statements)


def import_cycles(package: Path) -> list[str]:
    """The modules of `package` (a folder) that import themselves through other modules of it, imports inside
    functions included, read from the source."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        home = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(home[: len(home) - node.level + 1] + [node.module or ""]).strip(".") if node.level \
                    else node.module
                imported |= {candidate for candidate in [base, *(f"{base}.{alias.name}" for alias in node.names)]
                             if candidate in modules}
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names if alias.name in modules}
        graph[name] = imported - {name}

    def reachable(start: str) -> set[str]:
        seen, todo = set(), list(graph[start])
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo.extend(graph[module])
        return seen

    return sorted(name for name in graph if name in reachable(name))


def test_no_two_modules_import_each_other_even_indirectly():
    assert import_cycles(PACKAGE) == []


def test_a_cycle_through_an_import_inside_a_function_is_found(tmp_path):
    """What cli.py and ct2.py did: each imported the other inside a function."""
    package = tmp_path / "pkg"
    (package / "translation").mkdir(parents=True)
    (package / "export").mkdir()
    for folder in (package, package / "translation", package / "export"):
        (folder / "__init__.py").write_text("")
    (package / "translation" / "cli.py").write_text("def load():\n    from ..export.ct2 import Backend\n")
    (package / "export" / "ct2.py").write_text("import os\n\n\ndef fail():\n    from ..translation.cli import describe\n")
    (package / "errors.py").write_text("")
    assert import_cycles(package) == ["pkg.export.ct2", "pkg.translation.cli"]
    (package / "export" / "ct2.py").write_text("def fail():\n    from ..errors import describe\n")
    assert import_cycles(package) == []


def test_the_package_imports_from_a_deleted_working_directory_and_stays_there(tmp_path):
    """torch's MKL cannot load from a deleted working directory (a fatal error) unless the import runs elsewhere;
    afterwards the process is back in its (deleted) directory."""
    import shlex

    gone = tmp_path / "gone"
    gone.mkdir()
    script = ("import os, hf_scratch_transformer; "
              "print(os.readlink('/proc/self/cwd').endswith('(deleted)'))")
    done = subprocess.run(["sh", "-c", f"cd {shlex.quote(str(gone))} && rmdir {shlex.quote(str(gone))} && exec "
                           f"{shlex.quote(sys.executable)} -c {shlex.quote(script)}"],
                          capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout.strip()) == (0, "True"), done.stderr[-2000:]
