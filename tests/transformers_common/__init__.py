"""transformers' own common model tests, run against this package's model.

`test_modeling_common.py` and `test_configuration_common.py` (ModelTesterMixin, ConfigTester) ship in the
transformers source distribution on PyPI, for the installed version; `load_common_tests()` fetches them once
with pip into a cache directory and imports them as the package `transformers_common_tests`. The three modules
they import that the source distribution does not ship are this package's own, in this folder:
`generation/test_utils.py` (GenerationTesterMixin: the generation checks this model must pass),
`exporters/test_export.py` (ExportTesterMixin: torch.export) and `utils/test_configuration_utils.py`
(config_common_kwargs). Nothing is fetched when this package is imported: the tests call `load_common_tests()`
from a fixture, which skips them with the reason when the files cannot be had.
"""

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import transformers

PACKAGE = "transformers_common_tests"
FROM_SDIST = ("test_modeling_common.py", "test_configuration_common.py")
OURS = Path(__file__).parent


class CommonTestsUnavailable(RuntimeError):
    """transformers' source distribution could not be downloaded (no network, no PyPI)."""


def cache_root() -> Path:
    root = os.environ.get("HF_SCRATCH_TEST_CACHE") or Path.home() / ".cache" / "hf-scratch-transformer"
    return Path(root) / f"transformers-{transformers.__version__}-common-tests"


def _extract_from_sdist(target: Path) -> None:
    """pip-download transformers' sdist of the installed version and copy the common test files to `target`."""
    with tempfile.TemporaryDirectory() as download:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps",
                   f"transformers=={transformers.__version__}", "-d", download]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise CommonTestsUnavailable(
                f"Could not download transformers {transformers.__version__}'s source distribution for its common "
                f"tests ({' '.join(command)}): {' '.join(result.stderr.split())[-500:]}"
            )
        (archive,) = Path(download).glob("transformers-*.tar.gz")
        with tarfile.open(archive) as tar:
            for name in FROM_SDIST:
                member = tar.getmember(f"transformers-{transformers.__version__}/tests/{name}")
                (target / name).write_bytes(tar.extractfile(member).read())


def load_common_tests():
    """Import and return (test_modeling_common, test_configuration_common, generation.test_utils)."""
    root = cache_root()
    package = root / PACKAGE
    if not all((package / name).is_file() for name in FROM_SDIST):
        staging = Path(tempfile.mkdtemp(dir=root.parent if root.parent.exists() else None))
        try:
            _extract_from_sdist(staging)
            package.mkdir(parents=True, exist_ok=True)
            for name in FROM_SDIST:
                os.replace(staging / name, package / name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    # Our own modules are copied on every load, so that edits to them take effect.
    for source in OURS.rglob("*.py"):
        relative = source.relative_to(OURS)
        destination = package / relative
        destination.parent.mkdir(parents=True, exist_ok=True)
        if not destination.exists() or destination.read_bytes() != source.read_bytes():
            shutil.copyfile(source, destination)
    _import_package(package)
    return (
        importlib.import_module(f"{PACKAGE}.test_modeling_common"),
        importlib.import_module(f"{PACKAGE}.test_configuration_common"),
        importlib.import_module(f"{PACKAGE}.generation.test_utils"),
    )


def _import_package(package: Path) -> None:
    """Import `package` (a folder) as the package PACKAGE from where it lies, so that its modules import by name, without
    putting its parent folder on sys.path."""
    if PACKAGE in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(PACKAGE, package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[PACKAGE]
        raise
