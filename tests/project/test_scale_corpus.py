"""The scale benchmark's corpus builder (benchmarks/corpus.py): distinct content, true
labels, the same bytes on every build, and a complete corpus reused as it is."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.support import LABELS, PHOTOS, ROOT_DIR

pytestmark = pytest.mark.tier("gate")

spec = importlib.util.spec_from_file_location("corpus", ROOT_DIR / "benchmarks" / "corpus.py")
assert spec is not None and spec.loader is not None
corpus = importlib.util.module_from_spec(spec)
sys.modules["corpus"] = corpus  # the process pool's workers unpickle its functions by name
spec.loader.exec_module(corpus)


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two photos per label, and a byte-identical pair across labels as the real set has."""
    root = tmp_path_factory.mktemp("photos")
    for label in LABELS:
        (root / label).mkdir()
        for src in sorted((PHOTOS / label).glob("*.jpg"))[:2]:
            (root / label / src.name).write_bytes(src.read_bytes())
    twin = sorted((PHOTOS / "daisy").glob("*.jpg"))[5].read_bytes()
    (root / "roses" / "twin.jpg").write_bytes(twin)
    (root / "tulips" / "twin.jpg").write_bytes(twin)
    (root / "README.txt").write_text("not in a label folder\n")
    return root


def test_corpus_distinct_labelled_and_deterministic(photos: Path, tmp_path: Path) -> None:
    first = corpus.build_corpus(photos, tmp_path / "a", 3, extra=4, processes=2)
    files = first["files"]
    sources = corpus.select_photos(photos)
    assert first["images_files"] == 3 * len(sources) == 36 and first["extra_files"] == 4
    # variant 0 is the photo itself; variants 1..2 and the extras are new content
    for f in files:
        data = (tmp_path / "a" / f["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == f["sha256"]
        assert f["path"].split("/")[1] == f["label"] == f["source"].split("/")[0]
        if f["variant"] == 0:
            assert data == (photos / f["source"]).read_bytes()
        else:
            with Image.open(tmp_path / "a" / f["path"]) as img:
                assert img.format == "JPEG" and 160 <= max(img.size) <= 500
    variants = [f["sha256"] for f in files if f["variant"] > 0]
    originals = {f["sha256"] for f in files if f["variant"] == 0}
    assert len(set(variants)) == len(variants) and not originals & set(variants)
    # the cross-label twins' variants differ: the seed is the path's, not the content's
    assert len(originals) == len(sources) - 1

    second = corpus.build_corpus(photos, tmp_path / "b", 3, extra=4, processes=1)
    assert [f["sha256"] for f in second["files"]] == [f["sha256"] for f in files]
    again = corpus.build_corpus(photos, tmp_path / "a", 3, extra=4)
    assert again["reused"] and not first["reused"]
    with pytest.raises(ValueError, match="another --corpus"):
        corpus.build_corpus(photos, tmp_path / "a", 2, extra=4)


def test_smaller_corpus_links_a_donors_files(photos: Path, tmp_path: Path) -> None:
    """A 2x corpus built beside a complete 3x one links its variants (the same inode) and
    records the same hashes as a build from nothing; a donor whose file was changed after its
    manifest was written is refused by name."""
    big = corpus.build_corpus(photos, tmp_path / "x3", 3, extra=4, processes=1)
    fresh = corpus.build_corpus(photos, tmp_path / "fresh", 2, extra=2, processes=1)
    small = corpus.build_corpus(
        photos, tmp_path / "x2", 2, extra=2, processes=1, donors=[tmp_path / "x3", tmp_path / "no"]
    )
    assert small["donors"] == [str(tmp_path / "x3")] and fresh["donors"] == []
    assert [f["sha256"] for f in small["files"]] == [f["sha256"] for f in fresh["files"]]
    in_big = {(f["source"], f["variant"]): tmp_path / "x3" / f["path"] for f in big["files"]}
    linked = [
        f
        for f in small["files"]
        if (tmp_path / "x2" / f["path"]).stat().st_ino
        == in_big[(f["source"], f["variant"])].stat().st_ino
    ]
    assert len(linked) == len(small["files"])  # variant 2 (x2's extra) is in x3's images

    victim = next(f for f in big["files"] if f["variant"] == 1)
    (tmp_path / "x3" / victim["path"]).write_bytes(b"changed")
    with pytest.raises(ValueError, match=victim["path"].split("/")[-1]):
        corpus.build_corpus(photos, tmp_path / "x2b", 2, extra=2, donors=[tmp_path / "x3"])
