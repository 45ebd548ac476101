"""The stages of :func:`chest_xray.partition_records`: probe pool, patients -> sites per scheme, per-site splits.

Every function is pure and deterministic given its ``rng`` (a seeded NumPy generator); the order of random draws is
the order :func:`chest_xray.partition_records` calls them in, so the same seed gives the same partition.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import numpy as np

SPLITS = ("train", "val", "test")


def patients_by_id(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by[str(r["patient_id"])].append(r)
    return {k: sorted(v, key=lambda r: r["path"]) for k, v in sorted(by.items())}


def majority_label(rows: list[dict[str, Any]]) -> int:
    c = Counter(int(r["label"]) for r in rows)
    return min(c, key=lambda k: (-c[k], k))


def _cut_contiguous(sizes: list[int], n_groups: int) -> list[int]:
    """Group index for each item of an ordered list so the groups are contiguous with near-equal total size.

    Item i goes to group floor(N * (cumulative size before i + size_i / 2) / total), i.e. by the position of its
    midpoint; with unit sizes this is the usual near-equal contiguous cut.
    """
    total = float(sum(sizes))
    out, cum = [], 0.0
    for s in sizes:
        g = int(n_groups * (cum + s / 2.0) / total) if total > 0 else 0
        out.append(min(max(g, 0), n_groups - 1))
        cum += s
    return out


def _cut_by_fractions(sizes: list[int], fractions: list[float]) -> list[int]:
    """Like :func:`_cut_contiguous` with group widths given by ``fractions`` (summing to 1)."""
    edges = np.cumsum(np.asarray(fractions, dtype=np.float64))
    edges[-1] = 1.0 + 1e-12
    total = float(sum(sizes))
    out, cum = [], 0.0
    for s in sizes:
        pos = (cum + s / 2.0) / total if total > 0 else 0.0
        out.append(int(np.searchsorted(edges, pos, side="right")))
        cum += s
    return [min(g, len(fractions) - 1) for g in out]


def split_patients(
    patients: dict[str, list[dict[str, Any]]], rng: np.random.Generator, fractions: tuple[float, ...]
) -> dict[str, str]:
    """Patient -> split, stratified by majority label and grouped by patient, sizes by image count."""
    by_class: dict[int, list[str]] = defaultdict(list)
    for pid, rows in patients.items():
        by_class[majority_label(rows)].append(pid)
    out: dict[str, str] = {}
    order: dict[int, list[str]] = {}
    for k in sorted(by_class):
        pids = sorted(by_class[k])
        pids = [pids[i] for i in rng.permutation(len(pids))]
        order[k] = pids
        groups = _cut_by_fractions([len(patients[p]) for p in pids], list(fractions))
        for p, g in zip(pids, groups):
            out[p] = SPLITS[g]
    _fill_empty_splits(out, order, {p: len(rows) for p, rows in patients.items()}, fractions)
    return out


def _fill_empty_splits(out: dict[str, str], order: dict[int, list[str]], sizes: dict[str, int],
                       fractions: tuple[float, ...]) -> None:
    """Give val and then test at least one patient each (in place) when the site has >= 3 patients.

    The image-count cut leaves val/test empty when a class has fewer than ~10 patients (no patient's midpoint falls
    in the narrow 0.8-0.9 / 0.9-1.0 bands). Each empty split with a non-zero fraction takes one patient from
    train: from the class with the most train patients (ties -> smaller label index, which keeps the classes
    balanced across the filled splits), the train patient with the fewest images (ties -> the last in that class's
    seeded order, nearest the val/test boundary). Train always keeps at least one patient. Deterministic: no
    random draws.
    """
    if len(out) < 3:
        return
    for split, frac in zip(SPLITS[1:], fractions[1:]):
        if frac <= 0 or split in out.values():
            continue
        train = {k: [p for p in pids if out[p] == "train"] for k, pids in order.items()}
        if sum(len(v) for v in train.values()) < 2:
            return
        k = min(train, key=lambda c: (-len(train[c]), c))
        cand = train[k]
        i = min(range(len(cand)), key=lambda j: (sizes[cand[j]], -j))  # fewest images; ties -> last in order
        out[cand[i]] = split


def move_to_eval_per_class(out: dict[str, str], patients: dict[str, list[dict[str, Any]]], m: int,
                        fractions: tuple[float, ...]) -> list[dict[str, Any]]:
    """Give each class at least ``m`` images in val and in test (in place) where the site holds enough of it.

    Applied per class k the site holds ``n_k >= 4 m`` images of (so that training keeps at least half of them):
    while val (then test) holds fewer than ``m`` images of class k, the train patient with an image of class k that
    has the fewest images of other classes (ties -> fewest images, then patient id) moves to that split, unless the
    move would leave train with fewer than ``n_k / 2`` images of class k. Patients stay whole; a split whose
    fraction is 0 is left alone. Deterministic: no random draws. Returns one record per move (class, split,
    patient, images) for the partition's parameters.
    """
    moves: list[dict[str, Any]] = []
    if m <= 0:
        return moves
    labs = {p: [int(r["label"]) for r in rows] for p, rows in patients.items()}
    for k in sorted({lab for ls in labs.values() for lab in ls}):
        n_k = sum(ls.count(k) for ls in labs.values())
        if n_k < 4 * m:
            continue
        for split, frac in zip(SPLITS[1:], fractions[1:]):
            if frac <= 0:
                continue
            while sum(labs[p].count(k) for p in out if out[p] == split) < m:
                cand = sorted((p for p in out if out[p] == "train" and k in labs[p]),
                              key=lambda p: (len(labs[p]) - labs[p].count(k), len(labs[p]), p))
                train_k = sum(labs[p].count(k) for p in out if out[p] == "train")
                if not cand or train_k - labs[cand[0]].count(k) < n_k / 2:
                    break
                out[cand[0]] = split
                moves.append({"class": k, "split": split, "patient": cand[0], "images": len(labs[cand[0]])})
    return moves



def probe_pool(patients: dict[str, list[dict[str, Any]]], plabel: dict[str, int], n_classes: int,
               probe_fraction: float, rng: np.random.Generator) -> set[str]:
    """Per class, a seeded random set of patients covering ~``probe_fraction`` of the class's images."""
    probe_pids: set[str] = set()
    if probe_fraction > 0:
        for k in range(n_classes):
            pids = sorted(p for p in patients if plabel[p] == k)
            pids = [pids[i] for i in rng.permutation(len(pids))]
            groups = _cut_by_fractions([len(patients[p]) for p in pids], [probe_fraction, 1.0 - probe_fraction])
            probe_pids.update(p for p, g in zip(pids, groups) if g == 0)
    return probe_pids


def assign_width(pool: dict[str, list[dict[str, Any]]], plabel: dict[str, int], n_classes: int,
                 n_sites: int) -> dict[str, int]:
    """``width`` scheme: per class, patients by median image width cut into ``n_sites`` contiguous groups."""
    site_of: dict[str, int] = {}
    for k in range(n_classes):
        pids = [p for p in pool if plabel[p] == k]
        pids.sort(key=lambda p: (float(np.median([r["width"] for r in pool[p]])), p))
        for p, g in zip(pids, _cut_contiguous([len(pool[p]) for p in pids], n_sites)):
            site_of[p] = g
    return site_of


def assign_dirichlet(pool: dict[str, list[dict[str, Any]]], plabel: dict[str, int], n_classes: int, n_sites: int,
                     rng: np.random.Generator, alpha: float, min_per_site: int, max_tries: int,
                     params: dict[str, Any]) -> dict[str, int]:
    """``dirichlet`` scheme: per class, site proportions ~ Dir(alpha), re-drawn until every site has
    ``min_per_site`` images; records the number of draws in ``params``.

    Raises:
        ValueError: no draw in ``max_tries`` meets ``min_per_site``.
    """
    params.update(alpha=alpha, min_per_site=min_per_site)
    for attempt in range(max_tries):
        trial: dict[str, int] = {}
        for k in range(n_classes):
            pids = sorted(p for p in pool if plabel[p] == k)
            if not pids:
                continue
            pids = [pids[i] for i in rng.permutation(len(pids))]
            props = rng.dirichlet(np.full(n_sites, float(alpha)))
            for p, g in zip(pids, _cut_by_fractions([len(pool[p]) for p in pids], list(props))):
                trial[p] = g
        counts = Counter()
        for p, g in trial.items():
            counts[g] += len(pool[p])
        if all(counts[s] >= min_per_site for s in range(n_sites)):
            params["dirichlet_draws"] = attempt + 1
            return trial
    raise ValueError(
        f"no Dirichlet(alpha={alpha}) draw gave every one of {n_sites} sites >= {min_per_site} images "
        f"in {max_tries} tries; raise alpha or lower min_per_site"
    )


def assign_pathological(pool: dict[str, list[dict[str, Any]]], plabel: dict[str, int], n_classes: int,
                        n_sites: int, rng: np.random.Generator, classes_per_site: int | None,
                        params: dict[str, Any]) -> dict[str, int]:
    """``pathological`` scheme: each site holds ``classes_per_site`` classes (round-robin over a seeded class
    order); each class is cut contiguously among its holders. Records the site classes in ``params``.

    Raises:
        ValueError: ``classes_per_site`` outside 1..C, or too few sites to cover the classes.
    """
    m = classes_per_site if classes_per_site is not None else max(1, n_classes - 1)
    if not 1 <= m <= n_classes:
        raise ValueError(f"classes_per_site must be in 1..{n_classes}, got {m}")
    if n_sites * m < n_classes:
        raise ValueError(f"{n_sites} sites x {m} classes cannot cover {n_classes} classes")
    order = [int(c) for c in rng.permutation(n_classes)]
    holders: dict[int, list[int]] = defaultdict(list)
    site_classes = {}
    for s in range(n_sites):
        site_classes[s] = sorted(order[(s * m + j) % n_classes] for j in range(m))
        for c in site_classes[s]:
            holders[c].append(s)
    params.update(classes_per_site=m, site_classes={f"site-{s + 1}": site_classes[s] for s in range(n_sites)})
    site_of: dict[str, int] = {}
    for k in range(n_classes):
        pids = sorted(p for p in pool if plabel[p] == k)
        pids = [pids[i] for i in rng.permutation(len(pids))]
        hs = holders[k]
        for p, g in zip(pids, _cut_contiguous([len(pool[p]) for p in pids], len(hs))):
            site_of[p] = hs[g]
    return site_of
