"""The pooled-data reference (``central``): the sites' training images pooled in one place, one model trained on
them. Not a federated method: it is the ceiling a federation's gap is read against (centralised training on the
union of the clients' data, the usual upper reference of federated learning, McMahan et al., 2017,
arXiv:1602.05629). Pure functions here (no NVFlare, torch or data loading); the adapter is
``hfl_components.flare.controllers.central``.
"""
from __future__ import annotations

import hashlib
from typing import Iterable, Mapping


def pool_rows(site_rows: Mapping[str, Iterable[Mapping]]) -> list[dict]:
    """The union of the sites' training rows, in site order then each site's own order.

    Args:
        site_rows: {site: [{"path": str, "label": int, ...}]}, each site's training images.

    Returns:
        ``[{"path", "label", "site"}]``: one row per image, ``site`` the site it came from.

    Raises:
        ValueError: an image listed by two sites (or twice by one) -- the partitions must be disjoint, and a
            pooled set that counted an image twice would not be the union; a row without a path or label (both
            name the site).
    """
    out: list[dict] = []
    seen: dict[str, str] = {}
    for site, rows in site_rows.items():
        for r in rows:
            if not r.get("path") or r.get("label") is None:
                raise ValueError(f"site {site}: a training row without a path or label: {dict(r)}")
            p = str(r["path"])
            if p in seen:
                raise ValueError(f"image {p} is listed by site {seen[p]} and site {site}; the pooled training set "
                                 "must be the union of disjoint site partitions")
            seen[p] = site
            out.append({"path": p, "label": int(r["label"]), "site": str(site)})
    return out


def rows_digest(rows: Iterable[Mapping]) -> str:
    """SHA-256 (hex) of a set of training images: the sorted ``path<TAB>label`` lines, so that the same images in
    any order give the same digest."""
    lines = sorted(f"{r['path']}\t{int(r['label'])}" for r in rows)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def trainer_site(specs: Mapping[str, dict], spec: dict) -> str:
    """The site that trains the pooled model: the first site (in name order) whose own model spec is ``spec`` (the
    deepest architecture), else the first site. Raises ValueError for no sites."""
    if not specs:
        raise ValueError("no sites to pool")
    names = sorted(specs)
    return next((s for s in names if dict(specs[s] or {}) == dict(spec)), names[0])


def summarise(v: dict) -> str:
    """The ``central`` record's one line (``status``, ``compare``): images pooled, from how many sites, the model
    and its input size, who trained it and whether it trained on exactly the pooled set."""
    if not isinstance(v, dict) or "n_train" not in v:
        return str(v)[:80]
    spec = v.get("spec") or {}
    model = "/".join(str(spec[k]) for k in ("family", "depth") if spec.get(k)) or "?"
    same = {True: "trained on exactly the pooled images", False: "TRAINED ON OTHER IMAGES THAN POOLED"}.get(
        v.get("trained_on_pool"), "")
    return (f"{v['n_train']} training images of {len(v.get('sites') or {})} sites pooled; {model} at "
            f"{v.get('input_size')} px, {v.get('epochs')} epoch{'' if v.get('epochs') == 1 else 's'}, trained at "
            f"{v.get('trainer')}"
            + (f"; {same}" if same else ""))
