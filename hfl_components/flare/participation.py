"""Who a job is for and who it reached: the expected sites a job names and the sites it was never deployed to.

A job built by ``nvflare_jobs.jobs.build_job`` carries the profile's sites in its meta under
:data:`EXPECTED_SITES_KEY`; NVFlare deploys a job to the sites connected when it starts (as long as at least
``min_clients`` are), so a hospital that was down is silently left out. The server workflow compares the two at
job start (``HFLController.note_participation``) and records every expected site it did not reach, with the reason,
so ``status``, ``results`` and ``metrics.json`` can name it. No NVFlare import: the CLI reads job meta with it too.
"""
from __future__ import annotations

EXPECTED_SITES_KEY = "cxr_hfl_expected_sites"  # job meta key (meta.json): the profile's site names


def expected_sites(meta: dict | None) -> list[str]:
    """The sites a job is meant for: its meta's :data:`EXPECTED_SITES_KEY`, else the site names of its
    ``deploy_map`` (``server`` and NVFlare's ``@ALL`` left out; entries may be names or ``{"sites": [...]}``).
    Returns a sorted list ([] when the meta names none)."""
    meta = meta or {}
    named = meta.get(EXPECTED_SITES_KEY)
    if isinstance(named, (list, tuple)) and named:
        return sorted({str(s) for s in named})
    out = set()
    for targets in (meta.get("deploy_map") or {}).values():
        for t in targets if isinstance(targets, list) else [targets]:
            names = (t.get("sites") or t.get("targets") or []) if isinstance(t, dict) else [t]
            out |= {str(s) for s in names if str(s) != "server" and not str(s).startswith("@")}
    return sorted(out)


def not_deployed(expected: list[str], deployed: list[str], min_clients: int | None = None) -> dict[str, str]:
    """{site: reason} for every expected site the job did not reach (NVFlare deployed it to ``deployed`` only).

    Args:
        expected: the job's expected sites (:func:`expected_sites`).
        deployed: the sites the job runs at (the server's job clients).
        min_clients: the job's ``min_clients`` (meta), named in the reason; None when unknown.
    """
    have = set(deployed)
    n = len(have)
    floor = f", min_clients {min_clients}" if min_clients is not None else ""
    why = (f"not connected to the server when the job started: NVFlare deployed it to the {n} connected "
           f"site{'s' if n != 1 else ''} only{floor}")
    return {s: why for s in sorted(expected) if s not in have}
