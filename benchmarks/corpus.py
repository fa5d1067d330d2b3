"""A photo corpus N times the real one, with distinct content and true labels.

Variant 0 of a photo is the photo itself (hard-linked, copied where links are refused);
variant ``k >= 1`` is a new JPEG made from it by a random horizontal flip, a crop keeping
80-100 % of each side, a rotation of up to 8 degrees (cropped back inside its corners),
brightness, contrast and saturation shifts of up to 15 %, a resize to 85-110 % of the
original's size (longer side kept within 240-500 px, the originals' range) and a re-encode at
JPEG quality 70-95 with 4:2:0 or 4:4:4 chroma. The parameters are drawn from a seed that is a
hash of ``(relative path, k)``: the same corpus on every machine, and a different variant for
every path, the byte-identical duplicates of the real set included. Every variant lands in
its photo's label folder, so its label is the true one.

Layout of a corpus directory::

    <corpus>/images/<label>/<stem>.jpg            variant 0 (the original)
    <corpus>/images/<label>/<stem>__v<k>.jpg      k = 1 .. factor - 1
    <corpus>/extra/<label>/<stem>__v<k>.jpg       k >= factor: spare variants (new photos)
    <corpus>/manifest.json                        written last: the corpus is complete

``manifest.json`` holds the settings, the generation time and one entry per file (path,
label, source, variant, bytes, sha256). A corpus whose manifest exists with the same settings
is reused as it is (:func:`build_corpus`): generating 110,000 files is done once.

Variant ``k`` of a photo is the same file in every corpus of the same photos, fraction and
generator version (its seed depends on the path and ``k`` only), whatever the factor. A
corpus is built from the files of complete *donor* corpora where they have them (hard links,
checked against the donor's manifest hash): the 1x, 10x and 30x corpora of a run that built
100x first cost links, not encodes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from io import BytesIO
from pathlib import Path
from typing import Any

from PIL import Image, ImageEnhance, ImageOps

__all__ = ["CorpusFile", "build_corpus", "make_variant", "select_photos", "variant_seed"]

GENERATOR_VERSION = 1
"""Bump when :func:`make_variant` changes: a corpus of another version is not reused."""
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
MIN_SIDE_PX, MAX_SIDE_PX = 240, 500
"""The variants' longer side is kept within this range (the real photos' is 240-500 px, a
few at 640-1024), so that decoding one costs what decoding a real photo costs."""


@dataclass(frozen=True)
class CorpusFile:
    """One file of a corpus: ``path`` relative to the corpus directory."""

    path: str
    label: str
    source: str
    variant: int
    bytes: int
    sha256: str


def variant_seed(relative_path: str, variant: int) -> int:
    """The seed of variant ``variant`` of the photo at ``relative_path`` (``<label>/<file>``):
    the first 8 bytes of SHA-256 of ``"<relative_path>#<variant>"``, an unsigned int."""
    digest = hashlib.sha256(f"{relative_path}#{variant}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def make_variant(image: Image.Image, seed: int) -> tuple[bytes, dict[str, Any]]:
    """A new JPEG from ``image`` (any mode), deterministic in ``seed``.

    Returns:
        The JPEG bytes and the parameters drawn (for the record).
    """
    rng = random.Random(seed)
    img = image.convert("RGB")
    params: dict[str, Any] = {}
    if rng.random() < 0.5:
        img = ImageOps.mirror(img)
        params["flip"] = True
    w, h = img.size
    cw, ch = round(w * rng.uniform(0.8, 1.0)), round(h * rng.uniform(0.8, 1.0))
    x0, y0 = rng.randint(0, w - cw), rng.randint(0, h - ch)
    img = img.crop((x0, y0, x0 + cw, y0 + ch))
    angle = rng.uniform(-8.0, 8.0)
    img = img.rotate(angle, resample=Image.Resampling.BILINEAR)
    # the largest centred box without the rotation's empty corners (for small angles)
    a = math.radians(abs(angle))
    iw = (cw * math.cos(a) - ch * math.sin(a)) / math.cos(2 * a)
    ih = (ch * math.cos(a) - cw * math.sin(a)) / math.cos(2 * a)
    iw, ih = max(1, min(cw, int(iw))), max(1, min(ch, int(ih)))
    if iw > cw // 2 and ih > ch // 2:  # very wide photos: keep the corners rather than a sliver
        left, top = (cw - iw) // 2, (ch - ih) // 2
        img = img.crop((left, top, left + iw, top + ih))
    for name, enhancer in (
        ("brightness", ImageEnhance.Brightness),
        ("contrast", ImageEnhance.Contrast),
        ("saturation", ImageEnhance.Color),
    ):
        factor = rng.uniform(0.85, 1.15)
        img = enhancer(img).enhance(factor)
        params[name] = round(factor, 3)
    longer = max(w, h) * rng.uniform(0.85, 1.1)
    longer = min(max(longer, MIN_SIDE_PX), MAX_SIDE_PX)
    scale = longer / max(img.size)
    size = (max(1, round(img.width * scale)), max(1, round(img.height * scale)))
    img = img.resize(size, Image.Resampling.BILINEAR)
    quality = rng.randint(70, 95)
    subsampling = rng.choice((0, 2))  # 4:4:4 or 4:2:0
    out = BytesIO()
    img.save(out, "JPEG", quality=quality, subsampling=subsampling)
    params.update(angle=round(angle, 2), size=list(size), quality=quality, subsampling=subsampling)
    return out.getvalue(), params


def select_photos(photos: Path, fraction: float = 1.0) -> list[str]:
    """The real photos, ``<label>/<file>`` relative to ``photos``, sorted: every image file
    of every label folder, or the first ``ceil(fraction x n)`` of each label's sorted files.
    Files at the top level (not in a label folder) are left out."""
    chosen: list[str] = []
    for label_dir in sorted(p for p in photos.iterdir() if p.is_dir()):
        files = sorted(
            p.name
            for p in label_dir.iterdir()
            if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
        )
        keep = len(files) if fraction >= 1 else max(1, math.ceil(fraction * len(files)))
        chosen.extend(f"{label_dir.name}/{name}" for name in files[:keep])
    return chosen


def _variant_name(relative: str, variant: int) -> str:
    label, name = relative.split("/", 1)
    stem = name.rsplit(".", 1)[0]
    return f"{label}/{stem}__v{variant}.jpg"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


VariantTask = tuple[str, str, str, list[tuple[str, int]], dict[int, tuple[str, str]]]
"""``(photos, corpus, photo, [(folder, variant)], {variant: (donor file, its sha256)})``."""


def _write_variants(task: VariantTask) -> list[CorpusFile]:
    """Process-pool task: the variants of one photo (``(folder, variant)`` pairs), each
    written atomically; a file already there (an interrupted build) is kept and hashed; a
    variant a donor corpus has is hard-linked from it (task[4]) and checked against the
    donor's manifest hash.

    Raises:
        ValueError: a donor's file is not the bytes its manifest records.
    """
    photos, corpus, relative, wanted, donors = task
    made: list[CorpusFile] = []
    image: Image.Image | None = None
    for folder, variant in wanted:
        target = Path(corpus) / folder / _variant_name(relative, variant)
        donor = donors.get(variant)
        if not target.exists() and donor is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):  # another file system: made below instead
                os.link(donor[0], target)
        if target.exists():
            data = target.read_bytes()
            if donor is not None and hashlib.sha256(data).hexdigest() != donor[1]:
                raise ValueError(f"{donor[0]}: not the bytes its corpus's manifest records")
        else:
            if image is None:
                with Image.open(Path(photos) / relative) as src:
                    src.load()
                    image = src.copy()
            data, _ = make_variant(image, variant_seed(relative, variant))
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, target)
        made.append(
            CorpusFile(
                path=f"{folder}/{_variant_name(relative, variant)}",
                label=relative.split("/", 1)[0],
                source=relative,
                variant=variant,
                bytes=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
            )
        )
    return made


def extra_plan(sources: list[str], factor: int, extra: int) -> list[tuple[str, int]]:
    """Which ``(photo, variant)`` pairs the ``extra`` spare files are: the photos in an order
    shuffled with seed 0, one new variant each (``factor``, then ``factor + 1``...)."""
    order = sorted(sources)
    random.Random(0).shuffle(order)
    return [(order[i % len(order)], factor + i // len(order)) for i in range(extra)]


def _link_original(photos: Path, corpus: Path, relative: str) -> CorpusFile:
    target = corpus / "images" / relative
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(photos / relative, target)
        except OSError:  # another file system, or links not allowed
            shutil.copyfile(photos / relative, target)
    return CorpusFile(
        path=f"images/{relative}",
        label=relative.split("/", 1)[0],
        source=relative,
        variant=0,
        bytes=target.stat().st_size,
        sha256=_sha256(target),
    )


def _settings(photos: Path, factor: int, fraction: float, extra: int) -> dict[str, Any]:
    return {
        "photos": str(photos.resolve()),
        "factor": factor,
        "fraction": fraction,
        "extra": extra,
        "generator_version": GENERATOR_VERSION,
    }


def read_manifest(corpus: Path) -> dict[str, Any] | None:
    """The corpus's manifest, or None when there is none (not built, or not finished)."""
    path = corpus / "manifest.json"
    if not path.exists():
        return None
    manifest: dict[str, Any] = json.loads(path.read_text())
    return manifest


def donor_index(
    settings: dict[str, Any], donors: Sequence[Path]
) -> tuple[dict[str, dict[int, tuple[str, str]]], list[str]]:
    """The variants (``k >= 1``) that complete donor corpora of the same photos, fraction
    and generator version hold: ``{photo: {k: (file, sha256)}}``, and those donors' paths."""
    index: dict[str, dict[int, tuple[str, str]]] = {}
    used: list[str] = []
    same = ("photos", "fraction", "generator_version")
    for donor in donors:
        manifest = read_manifest(donor)
        if manifest is None or any(manifest["settings"][k] != settings[k] for k in same):
            continue
        used.append(str(donor))
        for f in manifest["files"]:
            if f["variant"] >= 1:
                index.setdefault(f["source"], {})[f["variant"]] = (
                    str(donor / f["path"]),
                    f["sha256"],
                )
    return index, used


def build_corpus(
    photos: Path,
    corpus: Path,
    factor: int,
    *,
    fraction: float = 1.0,
    extra: int = 0,
    processes: int = 2,
    chunksize: int = 8,
    donors: Sequence[Path] = (),
) -> dict[str, Any]:
    """Build (or reuse) a corpus of ``factor`` variants of each selected photo, plus
    ``extra`` spare variants under ``extra/`` (the new photos of an incremental ingest).

    Args:
        photos: the real photos, ``<label>/<file>``.
        corpus: the corpus directory (created; reused when its manifest has these settings).
        factor: variants per photo, >= 1 (1: the originals only).
        fraction: share of each label's photos used, 0 < fraction <= 1.
        extra: spare variants, >= 0.
        processes: worker processes that decode, transform and encode.
        chunksize: photos per task sent to a worker.
        donors: other corpus directories whose files are linked where they hold the same
            variant: those complete and of the same photos, fraction and generator version
            (others are passed over).

    Returns:
        The manifest: ``settings``, ``files`` (list of :class:`CorpusFile` as dicts),
        ``images_files``, ``extra_files``, ``images_bytes``, ``extra_bytes``,
        ``generation_seconds`` (wall time of the build that made it) and ``reused``
        (True when this call found it complete).

    Raises:
        ValueError: ``corpus`` holds a complete corpus with other settings, or a donor's
            file is not the bytes its manifest records.
    """
    if factor < 1 or not 0 < fraction <= 1 or extra < 0:
        raise ValueError(f"factor {factor} >= 1, 0 < fraction {fraction} <= 1, extra {extra} >= 0")
    settings = _settings(photos, factor, fraction, extra)
    manifest = read_manifest(corpus)
    if manifest is not None:
        if manifest["settings"] != settings:
            raise ValueError(
                f"{corpus} holds a corpus built with {manifest['settings']}, not {settings}: "
                "use another --corpus directory"
            )
        return {**manifest, "reused": True}
    t0 = time.perf_counter()
    sources = select_photos(photos, fraction)
    files = [_link_original(photos, corpus, rel) for rel in sources]
    wanted: dict[str, list[tuple[str, int]]] = {
        rel: [("images", k) for k in range(1, factor)] for rel in sources
    }
    for rel, k in extra_plan(sources, factor, extra):
        wanted[rel].append(("extra", k))
    donated, used = donor_index(settings, donors)
    tasks: Iterable[VariantTask] = (
        (str(photos), str(corpus), rel, pairs, donated.get(rel, {}))
        for rel, pairs in wanted.items()
        if pairs
    )
    with ProcessPoolExecutor(max_workers=processes) as pool:
        for made in pool.map(_write_variants, tasks, chunksize=chunksize):
            files.extend(made)
    seconds = time.perf_counter() - t0
    in_images = [f for f in files if f.path.startswith("images/")]
    manifest = {
        "settings": settings,
        "generation_seconds": round(seconds, 1),
        "processes": processes,
        "donors": used,
        "images_files": len(in_images),
        "extra_files": len(files) - len(in_images),
        "images_bytes": sum(f.bytes for f in in_images),
        "extra_bytes": sum(f.bytes for f in files) - sum(f.bytes for f in in_images),
        "files": [asdict(f) for f in files],
    }
    tmp = corpus / ".manifest.json.tmp"
    tmp.write_text(json.dumps(manifest) + "\n")
    os.replace(tmp, corpus / "manifest.json")
    return {**manifest, "reused": False}
