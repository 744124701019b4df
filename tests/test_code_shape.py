"""The package stays readable: no function or method longer than MAX_LINES (its decorators and docstring
counted). A longer one is split into named helpers."""

import ast
import textwrap
from pathlib import Path

import hf_scratch_transformer

PACKAGE = Path(hf_scratch_transformer.__file__).resolve().parent
MAX_LINES = 60


def long_functions(source: str, filename: str, limit: int = MAX_LINES) -> list[str]:
    """`file:line name (N lines)` of every function or method in `source` longer than `limit` lines."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [decorator.lineno for decorator in node.decorator_list])
            lines = node.end_lineno - start + 1
            if lines > limit:
                found.append(f"{filename}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_in_the_package_is_longer_than_60_lines():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) >= 10, modules  # the package's own modules were found
    too_long = [entry for path in modules
                for entry in long_functions(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE)))]
    assert not too_long, f"split into named helpers: {too_long}"


def test_the_check_finds_a_long_function_and_method():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))  # with the def line: MAX_LINES + 1 lines
    source = f"def short():\n    return 1\n\n\ndef too_long():\n{body}\n\n\nclass C:\n    @staticmethod\n" \
             f"    def method():\n{textwrap.indent(body, '    ')}\n"
    assert long_functions(source, "synthetic.py") == ["synthetic.py:5 too_long (61 lines)",
                                                      f"synthetic.py:{MAX_LINES + 10} method (62 lines)"]
    assert long_functions(f"def exactly():\n{body[: body.rindex(chr(10))]}\n", "ok.py") == []


MAX_TRAINING_LOOP_LINES = 250
TESTS = Path(__file__).resolve().parent


def class_lines(source: str, name: str) -> int:
    """The lines of the top-level class `name` in `source`, its decorators counted."""
    [node] = [node for node in ast.parse(source).body if isinstance(node, ast.ClassDef) and node.name == name]
    return node.end_lineno - min([node.lineno] + [decorator.lineno for decorator in node.decorator_list]) + 1


def test_the_training_loop_class_stays_within_250_lines():
    """`TrainingLoop` is the step and what is due after it; its pieces are classes and functions of their own."""
    source = (PACKAGE / "training" / "loop.py").read_text(encoding="utf-8")
    assert class_lines(source, "TrainingLoop") <= MAX_TRAINING_LOOP_LINES


def path_changes(source: str, filename: str) -> list[str]:
    """`file:line` of every call of sys.path's insert/append/extend in `source`, code in strings too (a script a test
    runs in a subprocess)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "sys.path" in node.value:
            try:
                found += [f"{filename}:{node.lineno}+{entry.split(':', 1)[1]}"
                          for entry in path_changes(textwrap.dedent(node.value), "")]
            except SyntaxError:  # prose that names sys.path, not code
                pass
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("insert", "append", "extend") and ast.unparse(node.func.value) == "sys.path"):
            found.append(f"{filename}:{node.lineno}")
    return found


def test_no_test_changes_sys_path():
    """Tests import the package, tests/, scripts/ and benchmarks/ through the path pytest is given (pyproject.toml's
    pythonpath, PYTHONPATH for subprocesses), so a test runs the same code whichever way it is started."""
    files = sorted(TESTS.rglob("*.py"))
    changes = [entry for path in files
               for entry in path_changes(path.read_text(encoding="utf-8"), str(path.relative_to(TESTS)))]
    assert not changes, f"use pyproject.toml's pythonpath or PYTHONPATH instead: {changes}"


def test_the_checks_find_a_long_class_and_a_path_change():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_TRAINING_LOOP_LINES))
    assert class_lines(f"class TrainingLoop:\n{body}\n", "TrainingLoop") == MAX_TRAINING_LOOP_LINES + 1
    path = "sys.path"  # the examples are built, so that this file holds no such call itself
    assert path_changes(f"import sys\n{path}.insert(0, 'x')\n", "a.py") == ["a.py:2"]
    script = f'SCRIPT = """\n    import sys\n    {path}.append("tests")\n"""\n'
    assert path_changes(script, "b.py") == ["b.py:1+3"]
    assert path_changes(f'"""Names {path} in prose: not code."""\nimport sys\nprint({path})\n', "c.py") == []
