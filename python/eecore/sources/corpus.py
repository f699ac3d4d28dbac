"""A local training corpus: the Python source of installed packages, deduplicated, split by package.

LayerSkip's code runs continually pretrain on source code; eecore's exit-ready training uses the
code that is already on the machine, so it needs no download. The corpus is built from the files
each installed *distribution* declares (`importlib.metadata`), so it is the same on every machine
that installed the same versions:

- only `.py` files between `min_chars` and `max_chars` characters, decoded as UTF-8;
- exact duplicates (after normalising line endings and trailing blanks) are kept once, the first
  in (distribution, path) order;
- whole distributions are held out for evaluation (`heldout`), so no held-out file, nor a copy
  of one vendored elsewhere, is trained on: duplicates are resolved held-out first;
- every distribution contributes at most `max_chars_per_package` characters (its files in path
  order), so one huge package (torch) does not drown the others.

    python -m eecore.sources.corpus --out corpus/        # writes train.txt, heldout.txt, manifest.json

Files are separated by `FILE_SEPARATOR` in the text files. Nothing here touches the network.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from importlib import metadata
from typing import Iterable, Optional

# The distributions eecore and its test extras install, and what they pull in (pip names).
DEFAULT_TRAIN_PACKAGES = (
    "torch", "numpy", "transformers", "huggingface-hub", "safetensors", "tokenizers", "scipy", "matplotlib",
    "pytest", "pytest-benchmark", "pluggy", "sympy", "networkx", "filelock", "fsspec", "packaging",
    "regex", "requests", "urllib3", "pyyaml", "typing-extensions", "pillow", "pyparsing", "cycler",
    "kiwisolver", "fonttools", "contourpy", "python-dateutil", "mpmath", "markupsafe", "idna",
    "charset-normalizer", "certifi", "iniconfig", "py-cpuinfo", "setuptools",
)
DEFAULT_HELDOUT_PACKAGES = ("jinja2", "tqdm", "gguf")

FILE_SEPARATOR = "\n\n# ---- next file ----\n\n"


@dataclass
class CorpusFile:
    package: str
    path: str       # relative to the distribution's location (site-packages)
    text: str
    sha256: str


@dataclass
class Corpus:
    train: list[CorpusFile] = field(default_factory=list)
    heldout: list[CorpusFile] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    duplicates: int = 0

    def text(self, split: str) -> str:
        return FILE_SEPARATOR.join(f.text for f in getattr(self, split))


def _normalise(text: str) -> str:
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return "\n".join(line.rstrip() for line in lines).strip("\n") + "\n"


def canonical_name(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): "PyYAML", "pyyaml" and "py_yaml" are one."""
    return re.sub(r"[-_.]+", "-", name).lower()


def package_files(name: str, min_chars: int, max_chars: int) -> Optional[tuple[str, list[tuple[str, str]]]]:
    """(version, [(relative path, normalised text)]) of one installed distribution's .py files,
    in path order; None when the distribution is not installed."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    out = []
    for entry in sorted(dist.files or [], key=str):
        rel = str(entry)
        if not rel.endswith(".py") or ".dist-info" in rel or rel.startswith(".."):
            continue
        try:
            raw = entry.locate().read_bytes()
        except OSError:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        text = _normalise(text)
        if min_chars <= len(text) <= max_chars:
            out.append((rel, text))
    return dist.version, out


def build_corpus(train_packages: Iterable[str] = DEFAULT_TRAIN_PACKAGES,
                 heldout_packages: Iterable[str] = DEFAULT_HELDOUT_PACKAGES, *, min_chars: int = 200,
                 max_chars: int = 100_000, max_chars_per_package: int = 4_000_000) -> Corpus:
    """The corpus of the installed `train_packages` and `heldout_packages` (see the module doc)."""
    train_packages, heldout_packages = list(train_packages), list(heldout_packages)
    held = {canonical_name(n) for n in heldout_packages}
    overlap = sorted(n for n in set(train_packages) if canonical_name(n) in held)
    if overlap:
        raise ValueError(f"build_corpus: packages {overlap} are both trained on and held out")
    corpus, seen = Corpus(), set()
    for split, names in (("heldout", heldout_packages), ("train", sorted(train_packages))):
        for name in names:
            found = package_files(name, min_chars, max_chars)
            if found is None:
                corpus.missing.append(name)
                continue
            version, files = found
            corpus.versions[name] = version
            budget = max_chars_per_package
            for rel, text in files:
                digest = hashlib.sha256(text.encode()).hexdigest()
                if digest in seen:
                    corpus.duplicates += 1
                    continue
                if len(text) > budget:
                    break
                seen.add(digest)
                budget -= len(text)
                getattr(corpus, split).append(CorpusFile(name, rel, text, digest))
    return corpus


def write_corpus(corpus: Corpus, out_dir: str) -> dict:
    """Writes train.txt, heldout.txt and manifest.json (packages, versions, files and hashes)."""
    os.makedirs(out_dir, exist_ok=True)
    for split in ("train", "heldout"):
        with open(os.path.join(out_dir, f"{split}.txt"), "w", encoding="utf-8") as f:
            f.write(corpus.text(split))
    manifest = {
        "versions": corpus.versions, "missing": corpus.missing, "duplicates_dropped": corpus.duplicates,
        "separator": FILE_SEPARATOR,
        **{split: {"files": len(files), "chars": sum(len(f.text) for f in files),
                   "sha256": hashlib.sha256(corpus.text(split).encode()).hexdigest(),
                   "packages": sorted({f.package for f in files})}
           for split, files in (("train", corpus.train), ("heldout", corpus.heldout))},
    }
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    return manifest


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eecore.sources.corpus", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--train-packages", nargs="+", default=list(DEFAULT_TRAIN_PACKAGES))
    ap.add_argument("--heldout-packages", nargs="+", default=list(DEFAULT_HELDOUT_PACKAGES))
    ap.add_argument("--max-chars-per-package", type=int, default=4_000_000)
    args = ap.parse_args(argv)
    corpus = build_corpus(args.train_packages, args.heldout_packages,
                          max_chars_per_package=args.max_chars_per_package)
    manifest = write_corpus(corpus, args.out)
    print(json.dumps({k: manifest[k] for k in ("train", "heldout", "missing", "duplicates_dropped")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
