"""A synthetic site for the in-process federation tests: ``n`` 18 x 18 noise images whose class shifts the mean
brightness, a manifest and a validated-shape site config of a small CNN. Its split rule is the caller's."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Callable

import numpy as np

SPEC = {"family": "cnn", "depth": "shallow", "width": 0.5, "in_channels": 1, "num_classes": 2}


def pairs_2_1_1(k: int) -> str:
    """Split of image ``k`` (class ``k % 2``): consecutive pairs go train, train, val, test, so every split holds
    both classes and train : val : test is about 2 : 1 : 1."""
    return ("train", "train", "val", "test")[(k // 2) % 4]


def first_four_cover(k: int) -> str:
    """Split of image ``k``: the first four go train, val, test, train (a 4-image site has each split), then
    train, train, val, test in turn."""
    return ("train", "train", "val", "test")[k % 4] if k >= 4 else ("train", "val", "test", "train")[k]


def synthetic_site(tmp_path: Path, name: str, n: int, split: Callable[[int], str], dp: dict | None = None) -> dict:
    """The site config of site ``name``: ``n`` PNG images under ``tmp_path`` (label ``k % 2``, patient ``p<k>``,
    split ``split(k)``; seeded by the name's length and ``n``), its manifest ``<name>.csv``, a 16 px
    :data:`SPEC` model, one thread; ``dp`` (the site config's key) when given."""
    from PIL import Image

    rng = np.random.default_rng(len(name) + n)
    man = tmp_path / f"{name}.csv"
    with man.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["path", "label", "split", "patient_id"])
        for k in range(n):
            f = tmp_path / f"{name}_{k}.png"
            Image.fromarray((rng.random((18, 18)) * 150 + 60 + 40 * (k % 2)).astype(np.uint8)).save(f)
            w.writerow([str(f), k % 2, split(k), f"p{k}"])
    cfg = {"site": name, "threads": 1, "seed": 0, "input_size": 16, "batch_size": 4, "augment_classes": [],
           "augment": "batch", "lr": 0.05, "momentum": 0.9, "class_weights": None, "finetune_lr": 0.01,
           "data": {"labels": "binary", "manifest": str(man)}, "model": dict(SPEC)}
    if dp is not None:
        cfg["dp"] = dict(dp)
    return cfg
