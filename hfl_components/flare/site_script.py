"""NVFlare Client API script run by every site, for every method (the only site code that imports NVFlare).

It learns its site name from NVFlare, finds the hospital's own config locally (``nvflare_jobs.site_config``),
and answers tasks by name with the handlers of :mod:`hfl_components.flare.site_methods`. A task that fails (bad
config, missing data, a bug) is answered with ``meta["status"] = "error"`` and a message naming the site, so the
server can log it and carry on with the other sites instead of the whole federation aborting.
"""
from __future__ import annotations

import logging
import os
import sys
import time
import traceback

import nvflare.client as flare
from nvflare.app_common.abstract.fl_model import FLModel

from hfl_components.flare.site_methods import HANDLERS
from hfl_components.flare.site_tasks import SiteRuntime, describe_error
from nvflare_jobs.site_config import load_site_config
from nvflare_jobs.privacy import redact_paths

log = logging.getLogger("cxr_hfl.site")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stdout)
    flare.init()
    site = flare.get_site_name()
    workdir = os.getcwd()
    job_id = flare.get_job_id()
    if job_id and job_id != "simulate_job" and os.path.isdir(os.path.join(workdir, job_id)):
        # a POC / provisioned site: cwd is the site's workspace, shared by every job; keep this job's state
        # (models, prototypes) in the job's own run folder so no job picks up another job's model
        workdir = os.path.join(workdir, job_id)
    runtime = None
    while flare.is_running():
        msg = flare.receive()
        if msg is None:
            break
        task = flare.get_task_name()
        meta = dict(msg.meta or {})
        meta.setdefault("round", msg.current_round or 0)
        try:
            if runtime is None:
                runtime = SiteRuntime(load_site_config(site), workdir)
            handler = HANDLERS.get(task)
            if handler is None:
                raise ValueError(f"unknown task {task!r} (known: {sorted(HANDLERS)})")
            log.info("site %s: task %s round %s", site, task, meta["round"])
            t0 = time.perf_counter()
            params, metrics, meta_out = handler(runtime, dict(msg.params or {}), meta)
            meta_out["compute_s"] = round(time.perf_counter() - t0, 3)  # the site's own work on this task
            flare.send(FLModel(params=params, metrics=metrics, meta=meta_out, current_round=msg.current_round))
        except Exception as e:  # noqa: BLE001 - reported to the server by name, never silently
            # an unreadable image is reported as the ImageReadError (file, reason, manifest line), not as the
            # transform wrapper MONAI raises around it
            reason = f"site {site}: task {task} failed: {describe_error(e)}"
            log.error("%s\n%s", reason, traceback.format_exc())
            # the server gets the reason without file paths / image names (they stay in this site's log)
            flare.send(FLModel(params={}, metrics={}, meta={"status": "error", "error": redact_paths(reason)},
                               current_round=msg.current_round))


if __name__ == "__main__":
    main()
