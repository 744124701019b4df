"""Build three small parallel corpora, unlike the shipped Bible, from the gettext catalogs of Debian and PyPI
packages (fully offline but for `apt-get download` and `pip download`; no web, no Hub):

* ``software_en_es``: English -> Spanish software messages (GNU tools, compilers, glibc, apt/dpkg, GTK/GNOME and
  KDE applications, VLC, Vim, Django, Sphinx), placeholders kept. About 60k pairs.
* ``games_en_ru``: English -> Russian game text (Battle for Wesnoth's campaigns, unit lore and help, the Flare RPG,
  Freeciv's nation legends, Warzone 2100): dialogue and lore, another script and another domain. About 23k pairs.
* ``games_en_el_5k``: English -> Greek from the same games, a low-resource size: 5,000 pairs at most.

    python benchmarks/build_corpora.py                       # all three into benchmarks/work/corpora/<name>/
    python benchmarks/build_corpora.py software_en_es --output_dir /data/corpora
    python benchmarks/build_corpora.py --check               # the built files: present, intact, splits disjoint

Each corpus directory holds ``train.jsonl``, ``validation.jsonl``, ``test.jsonl`` (one
``{"translation": {"en": ..., "es": ...}, "origins": ["package/catalog", ...]}`` per line, train.py's format),
``manifest.json`` (package versions and SHA-256s, counts, drop reasons, statistics, file hashes) and ``README.md``
(its data card). Package versions are pinned below, so a rebuild writes the same bytes; a pin that the apt lists no
longer hold is an error naming it. The packages are cached in ``--download_dir``. The cleaning and splitting rules
are in ``gettext_pairs.py``. The catalogs are GPL / LGPL / BSD-licensed: build the data where you use it, do not
commit or ship it.
"""

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path

from gettext_pairs import (
    DROP_REASONS,
    FREECIV_CONTEXT,
    WESNOTH_CONTEXT,
    Harvest,
    capped,
    chosen_pairs,
    harvest_catalog,
    near_duplicate_key,
    placeholders,
    split_records,
)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT_DIR = ROOT / "benchmarks" / "work" / "corpora"
SPLITS = ("train", "validation", "test")
LICENCE_MENTIONS = {"GPL": r"GNU General Public License|/GPL", "LGPL": r"GNU (?:Lesser|Library) General Public|/LGPL",
                    "GFDL": r"GNU Free Documentation License", "BSD": r"\bBSD\b", "Expat/MIT": r"\b(?:Expat|MIT)\b"}


class CorpusBuildError(Exception):
    """A build that cannot go on: the message names the cause and the fix."""


@dataclass(frozen=True)
class Source:
    """One package whose catalogs are read: a Debian package (`apt-get download`) or a PyPI wheel."""

    package: str
    version: str
    index: str = "debian"  # or "pypi"
    catalogs: tuple[str, ...] = ()  # catalog names to read (file stems); empty: every catalog of the language
    context_prefix: str | None = None  # the pattern of a context written into the msgids (gettext_pairs.py)


@dataclass(frozen=True)
class CorpusSpec:
    name: str
    target_lang: str  # the translation's language code, also its catalog directory (es -> es/LC_MESSAGES)
    description: str
    sources: tuple[Source, ...]
    validation_permille: int
    test_permille: int
    max_pairs: int | None = None
    source_lang: str = "en"


def debian(*packages_and_versions: str, **options) -> tuple[Source, ...]:
    """Sources from "package=version" strings."""
    return tuple(Source(*item.split("=", 1), **options) for item in packages_and_versions)


SOFTWARE_SOURCES = debian(
    "libc-l10n=2.36-9+deb12u14", "coreutils=9.1-1", "gcc-12-locales=12.2.0-14+deb12u1", "binutils-common=2.40-2",
    "gettext=0.21-12", "gettext-base=0.21-12", "bash=5.2.15-2+b13", "findutils=4.9.0-4", "tar=1.34+dfsg-1.2+deb12u1",
    "grep=3.8-5", "sed=4.9-1+deb12u1", "wget=1.21.3-1+deb12u1", "gnupg-l10n=2.2.40-1.1+deb12u2", "apt=2.6.2",
    "dpkg=1.21.23", "util-linux-locales=2.38.1-5+deb12u3", "e2fsprogs-l10n=1.47.0-2", "diffutils=1:3.8-4",
    "make=4.3-4.1", "nano=7.2-1+deb12u1", "gawk=1:5.2.1-2", "texinfo=6.8-6+b1", "procps=2:4.0.2-3",
    "login=1:4.13+dfsg1-1+deb12u2", "sudo=1.9.13p3-1+deb12u4", "xz-utils=5.4.1-1+deb12u2", "cpio=2.13+dfsg-7.1",
    "bison=2:3.8.2+dfsg-1+b1", "flex=2.6.4-8.2", "m4=1.4.19-3", "libgpg-error-l10n=1.46-1",
    "aptitude-common=0.8.13-5", "mc-data=3:4.8.29-2", "vim-runtime=2:9.0.1378-2+deb12u2",
    "libgtk-3-common=3.24.38-2~deb12u3", "libgtk-4-common=4.8.3+ds-2+deb12u1", "libglib2.0-data=2.74.6-2+deb12u9",
    "gnome-control-center-data=1:43.6-2~deb12u1", "nautilus-data=43.2-1", "evince-common=43.1-2+deb12u1",
    "gedit-common=44.2-1", "vlc-l10n=3.0.24-0+deb12u1", "konsole=4:22.12.3-1+deb12u1", "dolphin=4:22.12.3-1",
    "okular=4:22.12.3-1+deb12u1", "kate5-data=4:22.12.3-1",
) + (Source("django", "5.2.8", index="pypi"), Source("sphinx", "8.2.3", index="pypi"))

WESNOTH_PACKAGES = ("data", "did", "dm", "dw", "ei", "httt", "l", "low", "nr", "sof", "sota", "sotbe", "thot", "trow",
                    "tsg", "ttb", "utbs")
WESNOTH_SOURCES = debian(*(f"wesnoth-1.16-{part}=1:1.16.9-1" for part in WESNOTH_PACKAGES),
                         context_prefix=WESNOTH_CONTEXT)
GAME_SOURCES = WESNOTH_SOURCES + (
    Source("flare-game", "1.14-1"),
    # freeciv-nations: nations, their legends and rulers' titles; the package's other catalogs are the client's UI
    Source("freeciv-data", "3.0.6-1+deb12u1", catalogs=("freeciv-nations",), context_prefix=FREECIV_CONTEXT),
    Source("warzone2100-data", "4.3.3-3"),
)

CORPORA = {
    spec.name: spec for spec in (
        CorpusSpec("software_en_es", "es", "English -> Spanish software messages: command-line tools, compilers, "
                   "the C library, package managers, GTK/GNOME and KDE applications, VLC, Vim, Django, Sphinx.",
                   SOFTWARE_SOURCES, validation_permille=30, test_permille=40),
        CorpusSpec("games_en_ru", "ru", "English -> Russian game text: Battle for Wesnoth (campaign dialogue and "
                   "narration, unit lore, help, game interface), Flare (RPG items, quests), Freeciv (nations and "
                   "their legends), Warzone 2100 (campaign and interface).",
                   GAME_SOURCES, validation_permille=50, test_permille=50),
        CorpusSpec("games_en_el_5k", "el", "English -> Greek game text from the same games (a low-resource size): "
                   "a deterministic sample of whole near-duplicate groups, 5,000 pairs at most.",
                   GAME_SOURCES, validation_permille=100, test_permille=100, max_pairs=5000),
    )
}


# ------------------------------------------------------------------------------------------------ the packages
def fetch(source: Source, download_dir: Path) -> Path:
    """The package file of ``source`` in ``download_dir``, downloaded unless a file of the pinned version is there."""
    download_dir.mkdir(parents=True, exist_ok=True)
    if source.index == "pypi":
        name = source.package.replace("-", "_").lower()
        found = sorted(download_dir.glob(f"{name}-{source.version}-*.whl"), key=lambda p: p.name.lower())
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                   "--dest", str(download_dir), f"{source.package}=={source.version}"]
    else:
        found = [path for path in sorted(download_dir.glob(f"{source.package}_*.deb")) if deb_version(path) ==
                 source.version]
        command = ["apt-get", "download", "--quiet", f"{source.package}={source.version}"]
    if not found:
        run_tool(command, download_dir, source)
        return fetch(source, download_dir)
    return found[0]


def run_tool(command: list[str], cwd: Path, source: Source) -> None:
    hint = ("run `apt-get update` (as root), or update the pin in benchmarks/build_corpora.py"
            if source.index == "debian" else "check the network to PyPI, or update the pin")
    try:
        result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise CorpusBuildError(f"{command[0]} is not installed: building the corpora needs Debian's apt-get and "
                               f"dpkg-deb, and pip.") from None
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise CorpusBuildError(f"`{' '.join(command)}` failed ({last}): {hint}.")


def deb_version(path: Path) -> str:
    return subprocess.run(["dpkg-deb", "--field", str(path), "Version"], capture_output=True, text=True,
                          check=True).stdout.strip()


def package_files(path: Path, wanted) -> dict[str, bytes]:
    """The regular files of a .deb (its data part; paths without "./") or a wheel whose path ``wanted(path)``
    accepts, by path. The .deb is streamed, not unpacked."""
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as wheel:
            return {name: wheel.read(name) for name in sorted(wheel.namelist()) if wanted(name)}
    files = {}
    with (subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(path)], stdout=subprocess.PIPE) as process,
          tarfile.open(fileobj=process.stdout, mode="r|") as archive):
        for member in archive:
            name = member.name.removeprefix("./")
            if member.isfile() and wanted(name):
                files[name] = archive.extractfile(member).read()
    if process.returncode != 0:
        raise CorpusBuildError(f"dpkg-deb could not read {path}: delete it (it is downloaded again) and rerun.")
    return dict(sorted(files.items()))


def catalog_name(path: str, lang: str) -> str | None:
    """The catalog a file path holds for ``lang`` (``.../es/LC_MESSAGES/NAME.mo`` -> NAME; Flare's
    ``.../MOD/languages/NAME.es.po`` -> MOD/NAME), None for any other file."""
    match = re.search(rf"(?:^|/){re.escape(lang)}/LC_MESSAGES/([^/]+)\.mo$", path)
    if match:
        return match.group(1)
    match = re.search(rf"(?:^|/)([^/]+)/languages/([^/]+)\.{re.escape(lang)}\.po$", path)
    return f"{match.group(1)}/{match.group(2)}" if match else None


def licences(source: Source, members: dict[str, bytes]) -> list[str]:
    """The licences a package declares: the License fields of a machine-readable Debian copyright file, a wheel's
    License-Expression / License / classifiers."""
    if source.index == "pypi":
        metadata_file = next(data for name, data in members.items() if name.endswith(".dist-info/METADATA"))
        headers = HeaderParser().parsestr(metadata_file.decode("utf-8"))
        declared = [headers[key] for key in ("License-Expression", "License") if headers[key]]
        declared += [value.split("::")[-1].strip() for value in headers.get_all("Classifier", [])
                     if value.startswith("License ::")]
        return sorted(set(declared)) or ["not declared: see the package"]
    copyright_file = members.get(f"usr/share/doc/{source.package}/copyright")
    if copyright_file is None:
        return ["no copyright file in the package (a symbolic link to another package's)"]
    text = copyright_file.decode("utf-8", "replace")
    if not text.startswith("Format:"):
        named = [name for name, pattern in LICENCE_MENTIONS.items() if re.search(pattern, text)]
        where = f"/usr/share/doc/{source.package}/copyright"
        return [f"free text naming {', '.join(named) or 'no known licence'} ({where})"]
    return sorted(set(re.findall(r"^License:[ \t]*(\S[^\n]*)", text, flags=re.MULTILINE)))


# -------------------------------------------------------------------------------------------------- the corpus
def read_sources(spec: CorpusSpec, download_dir: Path) -> tuple[Harvest, list[dict]]:
    """Harvest every catalog of the spec's language from its packages; returns the harvest and, per package, its
    manifest entry (version, file, SHA-256, licences, entries seen per catalog)."""
    import polib

    harvest, described = Harvest(), []
    for source in spec.sources:
        path = fetch(source, download_dir)
        wanted = {f"usr/share/doc/{source.package}/copyright"}
        files = package_files(path, lambda name, wanted=wanted: catalog_name(name, spec.target_lang) is not None
                              or name in wanted or name.endswith(".dist-info/METADATA"))
        seen = {}
        for name, data in files.items():
            catalog = catalog_name(name, spec.target_lang)
            if catalog is None or (source.catalogs and catalog not in source.catalogs):
                continue
            parsed = polib.pofile(data.decode("utf-8")) if name.endswith(".po") else polib.mofile(data)
            origin = f"{source.package}/{catalog}"
            seen[catalog] = seen.get(catalog, 0) + harvest_catalog(parsed, origin, harvest, source.context_prefix)
        if not seen:
            named = f" named {', '.join(source.catalogs)}" if source.catalogs else ""
            raise CorpusBuildError(f"{path.name} holds no {spec.target_lang!r} catalog{named}: fix the source list "
                                   f"of {spec.name} in benchmarks/build_corpora.py.")
        described.append({"index": source.index, "package": source.package, "version": source.version,
                          "file": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                          "licences": licences(source, files), "entries_per_catalog": seen})
    return harvest, described


def split_statistics(records: list[dict], source_lang: str, target_lang: str) -> dict:
    """Counts and means of one split: pairs, mean words per side, pairs whose English holds a placeholder, a
    newline."""
    count = len(records)

    def mean(values) -> float:
        return round(sum(values) / count, 2) if count else 0.0

    return {
        "pairs": count,
        f"mean_words_{source_lang}": mean(len(r["source"].split()) for r in records),
        f"mean_words_{target_lang}": mean(len(r["target"].split()) for r in records),
        f"mean_chars_{target_lang}": mean(len(r["target"]) for r in records),
        "with_placeholder": sum(bool(placeholders(r["source"])) for r in records),
        "with_newline": sum("\n" in r["source"] for r in records),
    }


def build_corpus(spec: CorpusSpec, download_dir: Path) -> tuple[dict[str, list[dict]], dict]:
    """The records per split and the manifest (without the files' hashes) of one corpus."""
    harvest, sources = read_sources(spec, download_dir)
    records = chosen_pairs(harvest)
    kept = capped(records, spec.max_pairs)
    splits = split_records(kept, spec.validation_permille, spec.test_permille)
    in_corpus: dict[str, int] = {}
    for record in kept:
        for origin in record["origins"]:
            in_corpus[origin] = in_corpus.get(origin, 0) + 1
    for source in sources:
        source["pairs_per_catalog"] = {catalog: in_corpus.get(f"{source['package']}/{catalog}", 0)
                                       for catalog in source["entries_per_catalog"]}
    manifest = {
        "corpus": spec.name, "description": spec.description,
        "languages": {"source": spec.source_lang, "target": spec.target_lang},
        "rules": "benchmarks/gettext_pairs.py", "split_permille": {"validation": spec.validation_permille,
                                                                   "test": spec.test_permille},
        "max_pairs": spec.max_pairs, "pairs_before_cap": len(records),
        "dropped": {reason: harvest.dropped.get(reason, 0) for reason in DROP_REASONS},
        "splits": {split: split_statistics(splits[split], spec.source_lang, spec.target_lang) for split in SPLITS},
        "sources": sources,
    }
    return splits, manifest


# ------------------------------------------------------------------------------------------------ the files
def write_corpus(directory: Path, splits: dict[str, list[dict]], manifest: dict) -> None:
    """The three JSON Lines files, manifest.json (with the files' SHA-256) and README.md (the data card); each file
    is written beside its place and then moved there, and nothing else in ``directory`` is touched."""
    directory.mkdir(parents=True, exist_ok=True)
    source_lang, target_lang = manifest["languages"]["source"], manifest["languages"]["target"]
    contents = {}
    for split in SPLITS:
        lines = [json.dumps({"translation": {source_lang: r["source"], target_lang: r["target"]},
                             "origins": r["origins"]}, ensure_ascii=False) + "\n" for r in splits[split]]
        contents[f"{split}.jsonl"] = "".join(lines).encode("utf-8")
        manifest["splits"][split]["sha256"] = hashlib.sha256(contents[f"{split}.jsonl"]).hexdigest()
    contents["manifest.json"] = (json.dumps(manifest, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    contents["README.md"] = data_card(manifest).encode("utf-8")
    for name, data in contents.items():
        temporary = directory / f".{name}.tmp"
        temporary.write_bytes(data)
        os.replace(temporary, directory / name)


def data_card(manifest: dict) -> str:
    """The corpus's README.md, from its manifest."""
    source_lang, target_lang = manifest["languages"]["source"], manifest["languages"]["target"]
    rows = [f"| {split} | `{split}.jsonl` | {s['pairs']} | {s[f'mean_words_{source_lang}']} | "
            f"{s[f'mean_words_{target_lang}']} | {s['with_placeholder']} ({percent(s['with_placeholder'], s['pairs'])})"
            f" | {s['with_newline']} |" for split, s in manifest["splits"].items()]
    sources = []
    for source in manifest["sources"]:
        catalogs = ", ".join(f"{name} {source['pairs_per_catalog'][name]}/{seen}"
                             for name, seen in source["entries_per_catalog"].items())
        names = source["licences"]
        shown = "; ".join(names[:5]) + (f"; +{len(names) - 5} more" if len(names) > 5 else "")
        sources.append(f"| {source['package']} ({source['index']}) | {source['version']} | {shown} | {catalogs} |")
    dropped = ", ".join(f"{reason} {count}" for reason, count in manifest["dropped"].items())
    cap = (f"{manifest['pairs_before_cap']} pairs before the cap of {manifest['max_pairs']} (whole near-duplicate "
           f"groups sampled by hash)" if manifest["max_pairs"] else f"{manifest['pairs_before_cap']} pairs")
    permille = manifest["split_permille"]
    built_by = (f"Built by `python benchmarks/build_corpora.py {manifest['corpus']}` from the gettext catalogs of the "
                f"packages below (versions pinned; SHA-256s in `manifest.json`); the rules are in "
                f"`benchmarks/gettext_pairs.py`. One line per pair: `{{\"translation\": {{\"{source_lang}\": ..., "
                f"\"{target_lang}\": ...}}, \"origins\": [\"package/catalog\", ...]}}`.")
    licence = ("**Licence**: each catalog is under its package's licence (below: GPL / LGPL for most, BSD for Django "
               "and Sphinx). Use the corpus for training and evaluation where you build it; do not commit or "
               "redistribute it.")
    header = (f"| split | file | pairs | mean words {source_lang} | mean words {target_lang} | English with a "
              f"placeholder | with a newline |")
    split_rule = (f"{cap}. Split by English text, near-duplicates together: SHA-256 of the near-duplicate key modulo "
                  f"1000 below {permille['test']} -> test, below {permille['test'] + permille['validation']} -> "
                  f"validation.")
    return "\n".join([
        f"# Data card: `{manifest['corpus']}`", "", manifest["description"], "", built_by, "", licence, "",
        "## Files and counts", "", header, "|---|---|---:|---:|---:|---:|---:|", *rows, "", split_rule, "",
        f"Dropped entries: {dropped}.", "",
        "## Sources", "", "| package | version | licences | catalogs: pairs in the corpus / entries read |",
        "|---|---|---|---|", *sources, "",
    ])


def percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f} %" if whole else "-"


def check_corpus(directory: Path) -> list[str]:
    """What is wrong with a built corpus: a missing or changed file, a malformed line, a count that differs from the
    manifest, an English text (or a near-duplicate of it) in two splits or twice in one. Empty when it is sound."""
    manifest_path = directory / "manifest.json"
    if not manifest_path.is_file():
        return [f"{manifest_path} is missing: build the corpus first (python benchmarks/build_corpora.py)"]
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        if {"source", "target"} - set(manifest["languages"]) or set(SPLITS) - set(manifest["splits"]):
            raise KeyError("languages or splits")
    except (ValueError, KeyError, TypeError):
        return [f"{manifest_path} is not a manifest this script wrote: build the corpus again"]
    problems, keys = [], {}
    for split in SPLITS:
        path = directory / f"{split}.jsonl"
        if not path.is_file():
            problems.append(f"{path} is missing")
            continue
        data, expected = path.read_bytes(), manifest["splits"][split]
        if hashlib.sha256(data).hexdigest() != expected.get("sha256"):
            problems.append(f"{path} differs from the file the manifest describes (changed after the build)")
        sources = split_sources(path, data, manifest["languages"], problems)
        if len(sources) != expected["pairs"]:
            problems.append(f"{path} holds {len(sources)} pairs, the manifest says {expected['pairs']}")
        if len(set(sources)) != len(sources):
            problems.append(f"{path} holds {len(sources) - len(set(sources))} repeated English texts")
        keys[split] = {near_duplicate_key(text): text for text in sources}
    present = list(keys)
    for index, first in enumerate(present):
        for second in present[index + 1:]:
            shared = sorted(keys[first].keys() & keys[second].keys())
            if shared:
                problems.append(f"{len(shared)} English texts (or near-duplicates of them) are in both {first} and "
                                f"{second}, e.g. {keys[first][shared[0]]!r} / {keys[second][shared[0]]!r}")
    return problems


def split_sources(path: Path, data: bytes, languages: dict, problems: list[str]) -> list[str]:
    """The English texts of a split file; a line that is no JSON record with both sides non-empty is a problem."""
    sources = []
    for number, line in enumerate(data.decode("utf-8").split("\n")[:-1], start=1):
        try:
            pair = json.loads(line)["translation"]
            source, target = pair[languages["source"]], pair[languages["target"]]
            if not (isinstance(source, str) and isinstance(target, str) and source.strip() and target.strip()):
                raise ValueError("an empty side")
        except (ValueError, KeyError, TypeError) as error:
            problems.append(f"{path} line {number}: not a pair ({error})")
            continue
        sources.append(source)
    return sources


# ----------------------------------------------------------------------------------------------------- the CLI
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"corpora to build: {', '.join(CORPORA)} (all)")
    parser.add_argument("--output_dir", type=Path, default=DEFAULT_OUTPUT_DIR,
                        help="each corpus goes to OUTPUT_DIR/NAME/ (default: benchmarks/work/corpora, git-ignored)")
    parser.add_argument("--download_dir", type=Path, default=DEFAULT_OUTPUT_DIR / "downloads",
                        help="where the packages are downloaded and kept (default: benchmarks/work/corpora/downloads)")
    parser.add_argument("--check", action="store_true",
                        help="build nothing: check the built corpora (files present and unchanged, splits disjoint)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in CORPORA]
    if unknown:
        parser.error(f"unknown corpus {', '.join(unknown)}: choose among {', '.join(CORPORA)}")
    args.names = args.names or list(CORPORA)
    return args


def environment_problem(error: OSError) -> str:
    """One line for an OSError of a build: a missing tool, or a directory that cannot be written."""
    if isinstance(error, FileNotFoundError) and error.filename in ("apt-get", "dpkg-deb"):
        return f"{error.filename} is not installed: building the corpora needs Debian's apt-get and dpkg-deb"
    return f"cannot write {error.filename or 'a file'}: {error.strerror}; choose another --output_dir / --download_dir"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.check:
        failed = False
        for name in args.names:
            problems = check_corpus(args.output_dir / name)
            failed |= bool(problems)
            print(f"{args.output_dir / name}: " + ("; ".join(problems) if problems else "ok (files as built, "
                                                   "splits disjoint by English text and near-duplicates)"))
        return 1 if failed else 0
    try:
        import polib  # noqa: F401
    except ImportError:
        print("error: building the corpora needs polib: pip install polib", file=sys.stderr)
        return 1
    for name in args.names:
        start = time.perf_counter()
        try:
            splits, manifest = build_corpus(CORPORA[name], args.download_dir)
            write_corpus(args.output_dir / name, splits, manifest)
        except CorpusBuildError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        except OSError as error:
            print(f"error: {environment_problem(error)}", file=sys.stderr)
            return 1
        counts = ", ".join(f"{split} {manifest['splits'][split]['pairs']}" for split in SPLITS)
        test = manifest["splits"]["test"]
        print(f"{name}: {counts}; test lines with a placeholder {test['with_placeholder']} "
              f"({percent(test['with_placeholder'], test['pairs'])}); {time.perf_counter() - start:.0f} s "
              f"-> {args.output_dir / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
