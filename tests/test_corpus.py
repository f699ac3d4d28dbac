"""The local training corpus (eecore.sources.corpus): built from installed distributions' Python
source, deterministic, offline, deduplicated held-out first, budgeted per package.

Fake distributions (a .dist-info with a RECORD, on a temporary sys.path entry) give full control
over the files; a few small real ones (iniconfig, pluggy, packaging, idna) check the real thing."""
from __future__ import annotations

import hashlib
import json
import socket
from importlib import metadata

import pytest

from eecore.sources import corpus as corpus_mod
from eecore.sources.corpus import FILE_SEPARATOR, build_corpus, main, package_files, write_corpus

REAL = ("iniconfig", "pluggy", "packaging", "idna")


def _code(tag: str, n: int = 300) -> str:
    """A normalised Python file of about n characters, different for each tag."""
    lines, i = [f"# {tag}"], 0
    while sum(len(l) + 1 for l in lines) < n:
        lines.append(f"value_{tag}_{i} = {i} * {len(tag)}")
        i += 1
    return "\n".join(lines) + "\n"


def _make_dist(site, name: str, files: dict[str, bytes | str], version: str = "1.0") -> None:
    """A distribution `name` installed in `site`: its files, a METADATA and a RECORD listing them."""
    norm = name.replace("-", "_")
    info = site / f"{norm}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    record = []
    for rel, content in files.items():
        path = (site / rel).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        record.append(f"{rel},,")
    # a .py file inside the .dist-info is metadata, not source: it must be skipped
    (info / "hook.py").write_text(_code("dist-info"))
    record += [f"{info.name}/METADATA,,", f"{info.name}/hook.py,,", f"{info.name}/RECORD,,"]
    (info / "RECORD").write_text("\n".join(record) + "\n")


SHARED = _code("shared", 400)   # vendored in both a held-out and a train distribution
HELD_ONLY = _code("heldonly", 350)
TRAIN_ONLY = _code("trainonly", 320)


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    site = tmp_path / "env" / "lib" / "site"  # "../../bin" stays inside tmp_path
    _make_dist(site, "eetest-held", {
        "eetest_held/__init__.py": HELD_ONLY,
        "eetest_held/vendored.py": SHARED,
    }, version="2.5")
    _make_dist(site, "eetest-train", {
        "eetest_train/a.py": TRAIN_ONLY,
        # the same file with CRLF line endings and trailing blanks: a duplicate after normalising
        "eetest_train/copy_of_shared.py": "\r\n".join(l + "  " for l in SHARED.split("\n")) + "\n\n\n",
        "eetest_train/tiny.py": "x = 1\n",                                    # below min_chars
        "eetest_train/latin1.py": ("s = 'caf\xe9'\n" * 40).encode("latin-1"),  # not UTF-8
        "eetest_train/data.txt": _code("notpython"),                            # not .py
        "../../bin/eetest_tool.py": _code("script"),                            # outside site-packages
    })
    # five files of 300 characters, in path order f0 < f1 < ... < f4
    _make_dist(site, "eetest-big", {f"eetest_big/f{i}.py": _code(f"big{i}", 300) for i in range(5)})
    monkeypatch.syspath_prepend(str(site))
    return site


def _no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the corpus builder opened a network connection")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


# ---- real distributions --------------------------------------------------------------------------


def test_real_build_is_deterministic_and_offline(tmp_path, monkeypatch):
    _no_network(monkeypatch)
    with pytest.raises(AssertionError):  # the guard itself works
        socket.create_connection(("example.com", 80))
    a = build_corpus(REAL[:3], REAL[3:], max_chars_per_package=60_000)
    b = build_corpus(list(reversed(REAL[:3])), REAL[3:], max_chars_per_package=60_000)  # train order is irrelevant
    assert a.train and a.heldout
    assert a.text("train") == b.text("train") and a.text("heldout") == b.text("heldout")
    assert [(f.package, f.path) for f in a.train] == [(f.package, f.path) for f in b.train]
    assert a.versions == {n: metadata.version(n) for n in REAL}
    assert {f.package for f in a.train} == set(REAL[:3]) and {f.package for f in a.heldout} == {"idna"}
    m1 = write_corpus(a, str(tmp_path / "a"))
    m2 = write_corpus(b, str(tmp_path / "b"))
    assert m1 == m2
    for name in ("train.txt", "heldout.txt", "manifest.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    for f in a.train + a.heldout:
        assert f.path.endswith(".py") and ".dist-info" not in f.path
        assert f.sha256 == hashlib.sha256(f.text.encode()).hexdigest()
        assert 200 <= len(f.text) <= 100_000


# ---- fake distributions ----------------------------------------------------------------------------


def test_files_selected_and_normalised(fake_site):
    version, files = package_files("eetest-train", 200, 100_000)
    assert version == "1.0"
    # sorted by path; no tiny, non-UTF-8, non-.py, out-of-tree or .dist-info file
    assert [rel for rel, _ in files] == ["eetest_train/a.py", "eetest_train/copy_of_shared.py"]
    assert files[1][1] == SHARED  # CRLF and trailing blanks normalised away
    assert package_files("eetest-no-such-dist", 200, 100_000) is None
    # max_chars drops the bigger files
    assert len(HELD_ONLY) < len(SHARED)
    assert [rel for rel, _ in package_files("eetest-held", 200, len(HELD_ONLY))[1]] == ["eetest_held/__init__.py"]
    assert [rel for rel, _ in package_files("eetest-held", len(SHARED), 100_000)[1]] == ["eetest_held/vendored.py"]


def test_heldout_never_in_train_and_duplicates_resolved_heldout_first(fake_site):
    c = build_corpus(["eetest-train", "eetest-big"], ["eetest-held"])
    held_paths = [f.path for f in c.heldout]
    assert held_paths == ["eetest_held/__init__.py", "eetest_held/vendored.py"]
    assert all(f.package == "eetest-held" for f in c.heldout)
    train_paths = [f.path for f in c.train]
    assert "eetest_train/copy_of_shared.py" not in train_paths  # the copy of a held-out file
    assert "eetest_train/a.py" in train_paths
    assert SHARED not in c.text("train") and SHARED in c.text("heldout")
    assert not {f.sha256 for f in c.train} & {f.sha256 for f in c.heldout}
    assert c.duplicates == 1
    assert c.versions == {"eetest-held": "2.5", "eetest-train": "1.0", "eetest-big": "1.0"}
    # with the held-out package trained on instead, the shared file is kept once, in train
    c2 = build_corpus(["eetest-train", "eetest-held"], [])
    assert sum(f.text == SHARED for f in c2.train) == 1 and c2.duplicates == 1


def test_missing_distributions_are_reported(fake_site):
    c = build_corpus(["eetest-train", "eetest-missing-b", "eetest-missing-a"], ["eetest-missing-held"])
    assert c.missing == ["eetest-missing-held", "eetest-missing-a", "eetest-missing-b"]
    assert set(c.versions) == {"eetest-train"}


def test_per_package_budget(fake_site):
    sizes = [len(_code(f"big{i}", 300)) for i in range(5)]
    budget = sum(sizes[:3]) + sizes[3] - 1  # room for three files, one character short of four
    c = build_corpus(["eetest-big", "eetest-train"], [], max_chars_per_package=budget)
    big = [f for f in c.train if f.package == "eetest-big"]
    assert [f.path for f in big] == [f"eetest_big/f{i}.py" for i in range(3)]  # a prefix in path order
    assert sum(len(f.text) for f in big) <= budget
    # the budget is per package: the other one is not charged for eetest-big's files
    assert [f.path for f in c.train if f.package == "eetest-train"] == ["eetest_train/a.py",
                                                                       "eetest_train/copy_of_shared.py"]
    exact = build_corpus(["eetest-big"], [], max_chars_per_package=sum(sizes[:4]))
    assert len(exact.train) == 4
    assert build_corpus(["eetest-big"], [], max_chars_per_package=sizes[0] - 1).train == []


def test_overlap_is_refused_naming_the_package(fake_site):
    with pytest.raises(ValueError, match="eetest-held"):
        build_corpus(["eetest-train", "eetest-held"], ["eetest-held"])
    # pip names are case- and separator-insensitive: another spelling is the same distribution
    with pytest.raises(ValueError, match="EETest_Held"):
        build_corpus(["EETest_Held"], ["eetest-held"])


def test_write_corpus_files_and_hashes(fake_site, tmp_path):
    c = build_corpus(["eetest-train", "eetest-big"], ["eetest-held", "eetest-gone"])
    out = tmp_path / "out"
    manifest = write_corpus(c, str(out))
    assert json.loads((out / "manifest.json").read_text()) == manifest
    for split, files in (("train", c.train), ("heldout", c.heldout)):
        data = (out / f"{split}.txt").read_bytes()
        assert hashlib.sha256(data).hexdigest() == manifest[split]["sha256"]
        text = data.decode("utf-8")
        assert text.split(FILE_SEPARATOR) == [f.text for f in files]
        assert manifest[split]["files"] == len(files)
        assert manifest[split]["chars"] == sum(len(f.text) for f in files)
        assert manifest[split]["packages"] == sorted({f.package for f in files})
    assert manifest["missing"] == ["eetest-gone"] and manifest["duplicates_dropped"] == 1
    assert manifest["separator"] == FILE_SEPARATOR
    assert manifest["versions"] == c.versions


def test_cli_main(fake_site, tmp_path, monkeypatch, capsys):
    _no_network(monkeypatch)
    out = tmp_path / "cli"
    assert main(["--out", str(out), "--train-packages", "eetest-train", "eetest-big",
                 "--heldout-packages", "eetest-held", "--max-chars-per-package", "700"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    expected = write_corpus(build_corpus(["eetest-train", "eetest-big"], ["eetest-held"],
                                         max_chars_per_package=700), str(tmp_path / "api"))
    assert manifest == expected
    assert (out / "train.txt").read_bytes() == (tmp_path / "api" / "train.txt").read_bytes()
    assert json.loads(capsys.readouterr().out)["train"] == expected["train"]


def test_default_package_lists_do_not_overlap():
    assert not set(corpus_mod.DEFAULT_TRAIN_PACKAGES) & set(corpus_mod.DEFAULT_HELDOUT_PACKAGES)
