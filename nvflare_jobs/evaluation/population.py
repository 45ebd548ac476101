"""The population-shift check on files (``predict``, ``site check``): :func:`check_files` reads a batch of image
files the way the model sees them, and compares it with the training population's reference
(:mod:`hfl_components.shift`) stored in a model file (header key ``population``) or given as a JSON file."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np


def load_reference(source: str | Path | Mapping[str, Any] | None, header: Mapping[str, Any] | None = None):
    """A population reference: ``source`` as a dict, a JSON file of one, or a cxr-hfl model file (its header's
    ``population``); else the given model ``header``'s; None when there is none.

    Raises:
        ValueError: a JSON file that holds no reference (one line naming the file).
    """
    if isinstance(source, Mapping):
        return dict(source)
    if source is not None:
        p = Path(source)
        if p.suffix.lower() == ".json":
            try:
                ref = json.loads(p.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"{p}: cannot read a population reference ({e})") from None
            if not isinstance(ref, dict) or "image" not in ref:
                raise ValueError(f"{p}: not a population reference (no 'image' part)")
            return ref
        from hfl_components.models.files import read_model_header

        return read_model_header(p).get("population")
    return (header or {}).get("population")


def check_files(files: Sequence[str | Path], reference: Mapping[str, Any], *, model=None, size: int = 64,
                aspect: str | None = None, thresholds: Mapping[str, float] | None = None,
                batch_size: int = 32) -> dict:
    """:func:`hfl_components.shift.check_batch` of image files: each file read with the evaluation transform at
    ``size`` px and ``aspect`` (as the model sees it), its pixel statistics, the model's features (when ``model``
    is given and the reference has a feature part) and its :func:`chest_xray.population.population_facts`. A file
    that cannot be read is left out and counted (``n_unreadable``); nothing is raised for it.

    Returns:
        :func:`hfl_components.shift.check_batch`'s dict plus ``n_unreadable``.
    """
    import torch

    from chest_xray import DEFAULT_ASPECT, build_transforms
    from chest_xray.population import population_facts
    from hfl_components.shift import check_batch, features_and_statistics

    tf = build_transforms(int(size), "eval", aspect=aspect or DEFAULT_ASPECT)
    xs, facts, bad = [], [], 0
    for f in files:
        try:
            facts.append(population_facts(f))
            xs.append(tf({"image": str(f), "label": 0})["image"])
        except Exception:  # noqa: BLE001 -- an unreadable file is the reader's business; the check counts it
            if len(facts) > len(xs):
                facts.pop()
            bad += 1
    if not xs:
        return {"n": 0, "checked": False, "warn": False, "groups": {}, "flags": {}, "n_unreadable": bad,
                "line": f"population check: not judged, no readable image ({bad} unreadable)"}
    X = torch.stack(xs)
    use_model = model is not None and (reference.get("features") is not None)
    if use_model:
        stats, feats = features_and_statistics(model, X, batch_size)
    else:
        from chest_xray.population import image_statistics

        stats, feats = image_statistics(X), None
    res = check_batch(reference, stats, facts, feats, thresholds)
    res["n_unreadable"] = bad
    return res


def batch_check(reference: Mapping[str, Any] | None, stats: list[np.ndarray], facts: list[dict],
                feats: list[np.ndarray] | None, thresholds: Mapping[str, float] | None = None) -> dict:
    """:func:`hfl_components.shift.check_batch` on statistics, facts and features collected image by image (as
    ``predict`` collects them while it scores); ``{"checked": False, "line": ...}`` without a reference, or with one
    that does not fit these statistics or features (another model's)."""
    from hfl_components.shift import check_batch

    if not reference:
        return {"checked": False, "warn": False, "n": len(stats),
                "line": "population check: not run, the model file records no training population"}
    if not stats:
        return {"checked": False, "warn": False, "n": 0, "line": "population check: not run, no image was read"}
    f = np.concatenate(feats) if feats and reference.get("features") else None
    try:
        return check_batch(reference, np.concatenate(stats), facts, f, thresholds)
    except ValueError as e:  # a reference of another model or statistics version: said, predictions unaffected
        return {"checked": False, "warn": False, "n": len(facts),
                "line": f"population check: not run, the model's population reference does not fit ({e})"}
