"""Before a job is submitted: are all the sites it expects connected now (POC and production alike)?

NVFlare deploys a job to the sites connected when it starts, as long as at least ``min_clients`` are; a hospital
that is down is left out without a word. ``submit`` therefore refuses a job whose expected sites
(``hfl_components.flare.participation.expected_sites``) are not all connected, where connected means heard from
within twice the client heartbeat interval (``participation.CONNECTED_WITHIN_S``); the override
(``--allow-missing-sites``) submits with one warning line per missing site, and the job records them as not
deployed.
"""
from __future__ import annotations

from hfl_components.flare.participation import CONNECTED_WITHIN_S, expected_sites, unreachable
from nvflare_jobs.deploy._env import DeployError

OVERRIDE_FLAG = "--allow-missing-sites"


def check_connected(job_name: str, meta: dict, heard: dict[str, float | None] | None,
                    allow_missing: bool = False) -> list[str]:
    """Check that every site the job expects is connected.

    Args:
        job_name: the job folder's name (for the message).
        meta: the job's ``meta.json`` (expected sites, ``min_clients``).
        heard: {site: seconds since the server last heard from it} (``participation.heard_from_status``), or None
            when the server could not be asked.
        allow_missing: the override: submit anyway.
    Returns:
        Warning lines (empty when every expected site is connected).
    Raises:
        DeployError: some expected site is not connected (or the server could not be asked) and not
            ``allow_missing``; the message names each site and why, and the override.
    """
    if heard is None:
        why = "the server did not say which sites are connected"
        if not allow_missing:
            raise DeployError(f"job {job_name}: {why}; nothing was submitted ({OVERRIDE_FLAG} submits anyway)")
        return [f"WARNING ({OVERRIDE_FLAG}): {why}; submitting anyway"]
    expected = expected_sites(meta)
    missing = unreachable(expected, heard)
    if not missing:
        return []
    lines = [f"{s}: {why}" for s, why in missing.items()]
    n_ok = len(expected) - len(missing)
    floor = meta.get("min_clients")
    if not allow_missing:
        raise DeployError(
            f"job {job_name} expects {len(expected)} sites, {len(missing)} of them not connected (connected means "
            f"heard within {CONNECTED_WITHIN_S:.0f} s):\n  " + "\n  ".join(lines) + "\nNVFlare would deploy it to "
            f"the {n_ok} connected sites only (min_clients {floor}) and leave the others out. Start those sites, "
            f"or submit anyway with {OVERRIDE_FLAG} (the job then records them as not deployed); nothing was "
            "submitted")
    out = [f"WARNING ({OVERRIDE_FLAG}): {line}; the job runs without it (recorded as not deployed)"
           for line in lines]
    if isinstance(floor, int) and n_ok < floor:
        out.append(f"WARNING: only {n_ok} expected sites are connected, fewer than the job's min_clients {floor}: "
                   "NVFlare will not start it until enough sites connect")
    return out
