"""Label schemes: the one owner of scheme names, class names and class counts.

Two schemes exist for the Kermany chest X-ray data (Kermany et al., Cell 2018):

* ``binary``: NORMAL=0, PNEUMONIA=1 (2 classes);
* ``subtype``: NORMAL=0, BACTERIAL=1, VIRAL=2 (3 classes; PNEUMONIA split by the ``_bacteria_`` / ``_virus_`` part
  of the Kermany file name, see :func:`chest_xray.dataset.label_index`).

Everything else (site configs, profiles, the server, evaluation) asks this module instead of spelling the names or
counts out again. :func:`one_label_scheme` is the server's check that every site of a federation declares the same
scheme.
"""
from __future__ import annotations

from collections.abc import Mapping

CLASS_NAMES: dict[str, list[str]] = {"binary": ["NORMAL", "PNEUMONIA"], "subtype": ["NORMAL", "BACTERIAL", "VIRAL"]}
LABEL_SCHEMES: tuple[str, ...] = tuple(CLASS_NAMES)  # ("binary", "subtype"); argparse choices, config checks
DEFAULT_LABEL_SCHEME = "binary"


class LabelSchemeMismatch(ValueError):
    """Sites of one federation declare different label schemes (the message names every site and its scheme)."""


def check_label_scheme(labels: str) -> str:
    """Return ``labels`` if it names a known scheme. Raises ValueError naming the known schemes otherwise."""
    if labels not in CLASS_NAMES:
        raise ValueError(f"unknown label scheme {labels!r}; expected one of {list(LABEL_SCHEMES)}")
    return labels


def class_names(labels: str) -> list[str]:
    """Class names of a scheme, index order (``class_names("subtype")[2] == "VIRAL"``). Raises ValueError."""
    return list(CLASS_NAMES[check_label_scheme(labels)])


def num_classes(labels: str) -> int:
    """Number of classes of a scheme: 2 for ``binary``, 3 for ``subtype``. Raises ValueError on an unknown one."""
    return len(CLASS_NAMES[check_label_scheme(labels)])


def scheme_for_num_classes(n: int) -> str:
    """The scheme with ``n`` classes, for files written before the scheme was stored with them.

    Raises:
        ValueError: no scheme has ``n`` classes (the message lists each scheme's count).
    """
    hits = [s for s, names in CLASS_NAMES.items() if len(names) == int(n)]
    if len(hits) != 1:
        counts = {s: len(v) for s, v in CLASS_NAMES.items()}
        raise ValueError(f"no single label scheme has {n} classes; schemes and class counts: {counts}")
    return hits[0]


def one_label_scheme(site_schemes: Mapping[str, str | None]) -> str | None:
    """The one label scheme declared by every site; refuse a mix.

    Args:
        site_schemes: ``{site name: declared scheme}``; ``None`` means the site did not declare one (an answer
            without the ``labels`` field) and is not counted.

    Returns:
        The common scheme, or ``None`` when no site declared one.

    Raises:
        LabelSchemeMismatch: two or more schemes are declared; the message names the sites of each scheme, e.g.
            ``"sites declare different label schemes: binary: site-1, site-2; subtype: site-3"``.
        ValueError: a site declares an unknown scheme (the message names the site).
    """
    by_scheme: dict[str, list[str]] = {}
    for site, labels in sorted(site_schemes.items()):
        if labels is None:
            continue
        if labels not in CLASS_NAMES:
            raise ValueError(f"site {site}: unknown label scheme {labels!r}; expected one of {list(LABEL_SCHEMES)}")
        by_scheme.setdefault(labels, []).append(site)
    if len(by_scheme) > 1:
        parts = "; ".join(f"{s}: {', '.join(sites)}" for s, sites in sorted(by_scheme.items()))
        raise LabelSchemeMismatch(f"sites declare different label schemes: {parts}")
    return next(iter(by_scheme), None)
