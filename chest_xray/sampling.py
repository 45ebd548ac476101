"""Class-stratified subsets of labelled records (the one implementation; used for site training caps, quick
external evaluations and ``cxr-hfl compare --max-images``)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def stratified_subset(rows: Sequence[dict[str, Any]], n: int | None, seed: int = 0) -> list[dict[str, Any]]:
    """At most ``n`` rows, class-stratified and seeded, in their original order.

    Manifests are written grouped by class, so a plain ``rows[:n]`` keeps a single class; here each class keeps a
    share proportional to its size: every row gets the key ``(k + 0.5) / n_c`` from its rank ``k`` in a seeded
    random permutation of its class (``n_c`` rows), and the ``n`` smallest keys are kept (ties: lower class first).
    Each class keeps about its proportional share ``n * n_c / N``, rounded to whole rows, so a rare class whose
    share is under half a row can be left out.

    Args:
        rows: dicts with an integer-like ``"label"``.
        n: subset size; ``None`` or 0, or ``n >= len(rows)``, returns all rows (a new list).
        seed: numpy ``default_rng`` seed.

    Returns:
        ``min(n, len(rows))`` rows, a sub-sequence of ``rows``.
    """
    if not n or n >= len(rows):
        return list(rows)
    rng = np.random.default_rng(seed)
    by_class: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        by_class.setdefault(int(r["label"]), []).append(i)
    keyed = []
    for c, idx in sorted(by_class.items()):
        perm = rng.permutation(len(idx))
        keyed += [((k + 0.5) / len(idx), c, idx[j]) for k, j in enumerate(perm)]
    keep = sorted(i for _, _, i in sorted(keyed)[:n])
    return [rows[i] for i in keep]
