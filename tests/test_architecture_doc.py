"""docs/architecture.md names only what exists: every `module.name` in backticks whose first part is a module or
folder of the package resolves (imported, then looked up attribute by attribute), every `path.py` in backticks is a
file, and every module of the package has its line in the page's tables."""

import importlib
import re
from pathlib import Path

from helpers import REPO

PACKAGE = REPO / "hf_scratch_transformer"
DOC = REPO / "docs" / "architecture.md"
DATA_SUFFIXES = {".md", ".json", ".txt", ".png", ".yaml", ".yml", ".lock", ".safetensors"}
BACKTICKED = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+(\(\))?")


def module_names(package: Path) -> dict[str, str]:
    """Short name -> dotted name below the package of every module and folder of `package`: `errors` ->
    `errors`, `training` -> `training`, `recipe` -> `training.recipe` (a file's name alone, where it is unique)."""
    names, seen = {}, {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        for end in range(1, len(parts) + 1):
            names[".".join(parts[:end])] = ".".join(parts[:end])
        if parts:
            seen.setdefault(parts[-1], set()).add(".".join(parts))
    names.update({short: next(iter(full)) for short, full in seen.items() if len(full) == 1 and short not in names})
    return names


def stale_references(text: str, package: Path, repo: Path) -> list[str]:
    """The backticked `module.name` and `path.py` references of `text` that do not exist in `package` / `repo` (a
file's name alone counts where a file of the package, tests/, scripts/ or benchmarks/ has it)."""
    modules, root = module_names(package), package.name
    files = {str(path.relative_to(package)) for path in package.rglob("*.py")}
    basenames = {Path(name).name for name in files} | {path.name for folder in ("tests", "scripts", "benchmarks")
                                                        for path in (repo / folder).rglob("*.py")}
    stale = []
    for span in dict.fromkeys(BACKTICKED.findall(text)):
        if "<" in span or Path(span).suffix in DATA_SUFFIXES:
            continue  # `tests/test_<module>.py`, `model_card.md`: patterns and files that are not code
        if span.endswith(".py") and " " not in span:
            if not ((repo / span).is_file() or span in files or span in basenames):
                stale.append(span)
            continue
        if not DOTTED.fullmatch(span):
            continue
        parts = span.removesuffix("()").removeprefix(f"{root}.").split(".")
        if parts[0] not in modules:
            continue  # `nn.LayerNorm`, `model.device`, `os.environ`: not this package's
        if not resolves(f"{root}.{modules[parts[0]]}", parts[1:]):
            stale.append(span)
    return stale


def resolves(module: str, names: list[str]) -> bool:
    """`module` imports and `names` are found in it: submodules first, then attributes."""
    try:
        found = importlib.import_module(module)
    except ImportError:
        return False
    for position, name in enumerate(names):
        if not hasattr(found, name):
            try:
                importlib.import_module(f"{module}.{'.'.join(names[:position + 1])}")
            except ImportError:
                return False
        found = getattr(found, name, None)
        if found is None:
            return False
    return True


def missing_modules(text: str, package: Path) -> list[str]:
    """The modules of `package` (paths below it; folders' __init__.py and metrics/ aside) that `text` does not name
    in backticks in a table row."""
    named = {span for line in text.splitlines() if line.startswith("|") for span in BACKTICKED.findall(line)}
    modules = [str(path.relative_to(package)) for path in sorted(package.rglob("*.py"))
               if not (path.name == "__init__.py" and path.parent != package) and "metrics" not in path.parts]
    return [module for module in modules if module not in named]


def test_every_name_the_architecture_page_cites_exists():
    assert stale_references(DOC.read_text(encoding="utf-8"), PACKAGE, REPO) == []


def test_every_module_of_the_package_has_its_line_on_the_architecture_page():
    assert missing_modules(DOC.read_text(encoding="utf-8"), PACKAGE) == []


def test_a_stale_name_a_stale_file_and_a_missing_module_are_found():
    """What the page said before the package was split into data/, training/, translation/, export/."""
    text = ("| `loop.py` | Launching (`loop.launched_world_size`), `arguments.run_length`, `data.py`, "
            "`errors.check_range`, `recipe.run_length`, `nn.LayerNorm`, `model.device`, `train.py` |\n")
    assert stale_references(text, PACKAGE, REPO) == ["loop.launched_world_size", "arguments.run_length", "data.py"]
    assert "training/loop.py" in missing_modules(text, PACKAGE)
    assert "errors.py" in missing_modules(text, PACKAGE)
    assert "training/loop.py" not in missing_modules("| `training/loop.py` | the loop |\n", PACKAGE)
