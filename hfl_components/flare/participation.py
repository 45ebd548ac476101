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


# NVFlare 2.9's client sends a heartbeat to the server every ``heart_beat_interval`` seconds (10 s unless the site's
# start command sets another); a site the server has not heard from within two intervals is not connected, though
# the server keeps listing it until its heartbeat timeout (cxr-hfl's kits: 180 s; NVFlare's default 600 s).
CLIENT_HEARTBEAT_INTERVAL_S = 10.0
CONNECTED_WITHIN_S = 2 * CLIENT_HEARTBEAT_INTERVAL_S


def heard_from_status(info: dict | None, now: float) -> dict[str, float | None]:
    """{site: seconds since the server last heard from it (None: the server gave no time)} from NVFlare's
    ``check_status`` answer (``{"clients": [{"client_name", "client_last_conn_time", ...}]}``); ``now`` is the
    current epoch time in seconds."""
    out = {}
    for c in (info or {}).get("clients") or []:
        last = c.get("client_last_conn_time") if isinstance(c, dict) else None
        if isinstance(c, dict) and c.get("client_name"):
            out[str(c["client_name"])] = None if not isinstance(last, (int, float)) else round(max(0.0, now - last), 1)
    return out


def unreachable(expected: list[str], heard: dict[str, float | None],
                within_s: float = CONNECTED_WITHIN_S) -> dict[str, str]:
    """{site: reason} for every expected site that is not connected now: the server does not list it, or last
    heard from it more than ``within_s`` seconds ago (default twice the client heartbeat interval). A listed site
    without a time counts as connected (the server cannot tell)."""
    out = {}
    for s in sorted(expected):
        if s not in heard:
            out[s] = "not connected to the server"
        elif heard[s] is not None and heard[s] > within_s:
            out[s] = (f"last heard {heard[s]:.0f} s ago (connected means heard within {within_s:.0f} s, twice the "
                      f"{within_s / 2:.0f} s heartbeat interval); it has probably stopped")
    return out
