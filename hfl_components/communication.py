"""Communication per site: what each site uploads and downloads over a run, from the server's per-task record.

Pure functions over the run record's ``rounds`` entries (``HFLController.broadcast`` writes one per task sent:
``bytes_up_per_site`` {site: bytes the site's answer carried} and ``bytes_down_per_site``, the bytes of the one message
every site of that task was sent). Bytes are those of the numpy arrays of a message (float32 weights: 4 bytes per
number); the task metadata (JSON: metrics, counts, names) is not counted.
"""
from __future__ import annotations

from typing import Iterable, Mapping


def bytes_per_site(rounds: Iterable[Mapping], peer_models: Mapping[str, int] | None = None) -> dict[str, dict]:
    """Bytes each site uploaded and downloaded over a run.

    A site is counted in a task when it answered it (its name is in that task's ``bytes_up_per_site``, an error
    answer included), which is how the run's totals count (``bytes_downloaded`` = message bytes x answers), so the
    per-site values add up to the run's ``bytes_uploaded`` / ``bytes_downloaded``.

    Args:
        rounds: the run record's ``rounds`` (each with ``bytes_up_per_site`` {site: int} and ``bytes_down_per_site``
            int; a missing field counts 0).
        peer_models: for a method that sends every site's model to every other site (FENS, Allouah et al., 2024,
            arXiv:2411.07182): {site: bytes of that site's own model}. Each site's ``peer_models_down`` is then the
            bytes of the *other* sites' models it receives: the sum over the other sites.

    Returns:
        ``{site: {"up": int, "down": int}}`` sorted by site, with ``"peer_models_down": int`` per site when
        ``peer_models`` is given; ``{}`` for no rounds.

    Raises:
        ValueError: a negative byte count (the message names the round and the site).
    """
    out: dict[str, dict] = {}
    for i, r in enumerate(rounds):
        down = int(r.get("bytes_down_per_site") or 0)
        for site, up in (r.get("bytes_up_per_site") or {}).items():
            up = int(up or 0)
            if up < 0 or down < 0:
                raise ValueError(f"round entry {i} ({r.get('task')}): negative bytes for site {site}")
            d = out.setdefault(str(site), {"up": 0, "down": 0})
            d["up"] += up
            d["down"] += down
    if peer_models:
        shares, total = peer_share(peer_models), sum(int(b) for b in peer_models.values())
        for site, d in out.items():
            d["peer_models_down"] = shares.get(site, total)
    return dict(sorted(out.items()))


def peer_share(model_bytes: Mapping[str, int]) -> dict[str, int]:
    """Bytes of the other sites' models each site receives when every site's model goes to every other site.

    Args:
        model_bytes: {site: bytes of the site's own model}.

    Returns:
        {site: sum of ``model_bytes`` over every other site}; with N sites of equal model size b, (N - 1) x b each.

    Raises:
        ValueError: a negative size (naming the site).
    """
    for site, b in model_bytes.items():
        if int(b) < 0:
            raise ValueError(f"site {site}: negative model size {b}")
    total = sum(int(b) for b in model_bytes.values())
    return {site: total - int(b) for site, b in sorted(model_bytes.items())}


def site_totals(per_site: Mapping[str, Mapping]) -> dict[str, float]:
    """Mean and largest per-site bytes over sites: ``{"up_mean", "up_max", "down_mean", "down_max"}`` plus
    ``"peer_models_down_mean"`` when the sites carry it; ``{}`` for no sites."""
    if not per_site:
        return {}
    out: dict[str, float] = {}
    for k in ("up", "down", "peer_models_down"):
        vals = [int(d[k]) for d in per_site.values() if k in d]
        if vals:
            out[f"{k}_mean"] = sum(vals) / len(vals)
            out[f"{k}_max"] = max(vals)
    return out
