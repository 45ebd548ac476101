"""The server's probe batch for OHFL's CKA layer alignment (and the 'acts' ground metric).

CKA compares two models on identical inputs, and the server holds no site data, so the probe comes from an
explicitly configured folder of *public* images (e.g. ../shared/data/chest_xray_224, patient-disjoint from
chest_xray_original, or the pool that ``cxr-hfl partition --probe-fraction`` reserves, given as its probe.csv).
Generated inputs are used only when asked for (``"generated"``), with a logged warning. A missing probe set is an
error, never a silent fallback.
"""
from __future__ import annotations

import csv
import random
from pathlib import Path

import torch

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".dcm"}


def list_probe_files(source: str | Path) -> list[Path]:
    """Image files of a probe folder (recursive) or a probe CSV (column ``path``, relative to the CSV).

    The shared ``chest_xray_224`` pool is special: given its root folder, only its committed ``probe`` part
    (``chest_xray/splits.py``, 320 images) is used, so the server never sees the tuning or evaluation images.

    Raises:
        FileNotFoundError: ``source`` does not exist. ValueError: a CSV without a ``path`` column.
    """
    p = Path(source)
    if p.is_dir() and p.name == "chest_xray_224":
        from chest_xray.splits import split_files

        files = [f for f in split_files("probe", p) if f.is_file()]
        if files:
            return files
    if p.is_file() and p.suffix.lower() == ".csv":
        with p.open(newline="", encoding="utf-8-sig", errors="surrogateescape") as f:  # non-UTF-8 names kept
            rows = [r for r in csv.DictReader(f) if any(str(v or "").strip() for v in r.values())]  # no blanks
        if rows and "path" not in rows[0]:
            raise ValueError(f"OHFL probe set {str(p)!r}: a probe CSV needs a path column (has {sorted(rows[0])})")
        return [(p.parent / r["path"]).resolve() if not Path(r["path"]).is_absolute() else Path(r["path"])
                for r in rows]
    if p.is_dir():
        return sorted(f for f in p.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES and f.is_file())
    raise FileNotFoundError(f"OHFL probe set {source!r} does not exist: give a folder of public images, a probe.csv, "
                            "or 'generated'")


def load_probe(source: str, input_size: int, n: int = 64, in_channels: int = 1, seed: int = 0, warn=None,
               files_out: list | None = None, aspect: str | None = None) -> torch.Tensor:
    """Build the probe batch.

    Args:
        source: folder / probe CSV of public images, or ``"generated"``.
        input_size: S, the side length the images are prepared at (the eval transforms of ``chest_xray``).
        n: number of images (default 64); fewer if the folder has fewer readable images.
        in_channels: channels the models expect.
        seed: which images are drawn.
        warn: callable for warnings (e.g. the controller's ``warning``).
        files_out: if a list, the file names of the images used are appended to it (in batch order).
        aspect: how non-square images are made square (``chest_xray.ASPECTS``); None = ``chest_xray.DEFAULT_ASPECT``
            (``stretch``), the sites' default, so the probe looks like the sites' training images.

    Returns:
        float32 tensor (n, in_channels, S, S).

    Raises:
        FileNotFoundError: the source does not exist. ValueError: fewer than 2 readable images.
    """
    if source == "generated":
        if warn:
            warn("OHFL probe: using GENERATED inputs (random noise) for CKA, as requested; layer alignment will be "
                 "less meaningful than with real public images")
        g = torch.Generator().manual_seed(seed)
        return torch.rand(n, in_channels, input_size, input_size, generator=g)
    from chest_xray import DEFAULT_ASPECT, build_transforms

    files = list_probe_files(source)
    random.Random(seed).shuffle(files)
    tf = build_transforms(input_size, "eval", aspect=aspect or DEFAULT_ASPECT)
    out, skipped = [], []
    for f in files:
        if len(out) >= n:
            break
        try:
            item = tf({"image": str(f), "label": 0})
            out.append(torch.as_tensor(item["image"]).float())
            if files_out is not None:
                files_out.append(f.name)
        except Exception as e:  # noqa: BLE001 - a bad public image is skipped and reported
            skipped.append(f"{f}: {e}")
    if skipped and warn:
        warn(f"OHFL probe: skipped {len(skipped)} unreadable images, e.g. {skipped[0]}")
    if len(out) < 2:
        raise ValueError(f"OHFL probe set {source!r}: fewer than 2 readable images")
    x = torch.stack(out)
    if x.shape[1] != in_channels:
        x = x[:, :1].expand(-1, in_channels, -1, -1).contiguous()
    return x
