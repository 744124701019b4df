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
