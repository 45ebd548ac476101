"""NVFlare Client API script run by every site, for every method (the only site code that imports NVFlare).

It learns its site name from NVFlare, finds the hospital's own config locally (``hfl_components.flare.site_config``),
and answers tasks by name with the handlers the method catalogue names (:func:`hfl_components.flare.dispatch.handler`). A task that fails (bad
config, missing data, a bug) is answered with ``meta["status"] = "error"`` and a message naming the site, so the
server can log it and carry on with the other sites instead of the whole federation aborting.
"""
from __future__ import annotations

import contextlib
import logging
import json
import os
import sys
import threading
import time
import traceback

import nvflare.client as flare
from nvflare.app_common.abstract.fl_model import FLModel

from hfl_components.flare.inprocess import task_meta
from hfl_components.flare.dispatch import handler as site_handler
from hfl_components.flare.site_tasks import SiteRuntime, describe_error
from hfl_components.flare.site_config import load_site_config
from hfl_components.flare.privacy import redact_paths

log = logging.getLogger("cxr_hfl.site")
PROGRESS_KEY = "cxr_hfl_progress"  # read by HFLController.handle_event
HEARTBEAT_S = 5.0  # hfl_components.wait_policy.HEARTBEAT_S


class Heartbeat:
    """While a task runs, send the site's progress (task, round, epoch, loss) to the server every ``HEARTBEAT_S``
    seconds (and at once when an epoch ends) through ``flare.log``: the server's liveness signal (a site that stops
    sending has stopped, ``hfl_components.wait_policy``) and the live per-site progress on the console."""

    def __init__(self):
        self.state: dict = {}
        self.runtime = None
        self._stop = threading.Event()
        self._busy = threading.Event()
        self._last_sent = None
        self._thread = threading.Thread(target=self._loop, name="cxr_hfl_heartbeat", daemon=True)
        self._thread.start()

    def start_task(self, task: str, rnd) -> None:
        self.state = {"task": task, "round": rnd}
        if self.runtime is not None:
            self.runtime.progress.clear()
        self._busy.set()
        self.send()

    def end_task(self) -> None:
        self._busy.clear()

    def send(self) -> None:
        try:
            from nvflare.apis.analytix import AnalyticsDataType

            st = dict(self.state, **(self.runtime.progress if self.runtime is not None else {}))
            flare.log(PROGRESS_KEY, json.dumps(st, default=float), AnalyticsDataType.TEXT)
            self._last_sent = (st.get("epoch"), time.monotonic())
        except Exception as e:  # noqa: BLE001 - progress is best effort; the task result is what counts
            log.debug("heartbeat not sent: %s", e)

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            if not self._busy.is_set():
                continue
            epoch = (self.runtime.progress if self.runtime is not None else {}).get("epoch")
            last = self._last_sent
            if last is None or last[0] != epoch or time.monotonic() - last[1] >= HEARTBEAT_S:
                self.send()

    def stop(self) -> None:
        self._stop.set()


@contextlib.contextmanager
def crash_leaves_site_out(run_dir: str | None):
    """While the block runs, a death of this job process (kill -9, out of memory) reads to NVFlare as an unknown
    exit, not as a job failure; the one place that relies on NVFlare's process return-code file.

    NVFlare 2.9 offers no setting for this: when a site's job process ends, the site's client parent reads its
    exit code from ``<run_dir>/<FLMetaKey.PROCESS_RC_FILE>`` (``_process_rc.txt``; else the process's own code)
    and reports the codes in ``client_executor.REPORTABLE_JOB_FAILURES`` to the server, which fails the whole job
    ("Failing job ... due to reported failure from <site>"). A dead site must only be left out of the round, as the
    server's wait policy does for a silent site; so while the block runs the file holds ``JobReturnCode.UNKNOWN``
    (127, not reportable), and it is removed when the block ends, so a normal end (or a Python error) reports
    NVFlare's own code. ``tests/test_consortium.py`` checks this contract against the installed NVFlare
    (docs/decisions.md). ``run_dir`` None (the simulator): nothing is written.

    Yields:
        the file written, or None.
    """
    if run_dir is None:
        yield None
        return
    from nvflare.apis.fl_constant import FLMetaKey
    from nvflare.apis.job_launcher_spec import JobReturnCode

    rc_file = os.path.join(run_dir, FLMetaKey.PROCESS_RC_FILE)
    with open(rc_file, "w") as f:
        f.write(str(int(JobReturnCode.UNKNOWN)))
    try:
        yield rc_file
    finally:
        if os.path.isfile(rc_file):
            os.remove(rc_file)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stdout)
    flare.init()
    site = flare.get_site_name()
    workdir = os.getcwd()
    job_id = flare.get_job_id()
    run_dir = None
    if job_id and job_id != "simulate_job" and os.path.isdir(os.path.join(workdir, job_id)):
        # a POC / provisioned site: cwd is the site's workspace, shared by every job; keep this job's state
        # (models, prototypes) in the job's own run folder so no job picks up another job's model
        workdir = run_dir = os.path.join(workdir, job_id)
    with crash_leaves_site_out(run_dir):
        _serve(site, workdir)


def _tracking_writer():
    """NVFlare's client-side TensorBoard-style writer (``nvflare.client.tracking.SummaryWriter``), or None."""
    try:
        from nvflare.client.tracking import SummaryWriter

        return SummaryWriter()
    except Exception as e:  # noqa: BLE001 - tracking is best effort; the task result is what counts
        log.warning("experiment tracking off: %s", e)
        return None


def _track(writer, metrics: dict, rnd, epoch_step: int) -> int:
    """Log a task's per-epoch losses and validation metrics (``hfl_components.flare.tracking``); returns the
    site's epoch counter after the task."""
    from hfl_components.flare.tracking import tracking_scalars

    scalars, epoch_step = tracking_scalars(metrics, int(rnd or 0), epoch_step)
    for tag, value, step in scalars if writer is not None else ():
        try:
            writer.add_scalar(tag, value, step)
        except Exception as e:  # noqa: BLE001
            log.debug("tracking scalar not sent: %s", e)
    return epoch_step


def _serve(site: str, workdir: str) -> None:
    """Answer tasks until NVFlare ends the job."""
    runtime = None
    beat = Heartbeat()
    writer, epoch_step = _tracking_writer(), 0
    while flare.is_running():
        msg = flare.receive()
        if msg is None:
            break
        task = flare.get_task_name()
        meta = task_meta(msg)  # + round and total_rounds (the sites' lr_schedule: cosine needs it)
        beat.start_task(task, meta["round"])
        try:
            if runtime is None:
                runtime = SiteRuntime(load_site_config(site), workdir)
                beat.runtime = runtime
            handler = site_handler(task)  # the catalogue entry's handler; ValueError for an unknown task
            log.info("site %s: task %s round %s", site, task, meta["round"])
            t0 = time.perf_counter()
            params, metrics, meta_out = handler(runtime, dict(msg.params or {}), meta)
            meta_out["compute_s"] = round(time.perf_counter() - t0, 3)  # the site's own work on this task
            epoch_step = _track(writer, metrics or {}, meta["round"], epoch_step)
            flare.send(FLModel(params=params, metrics=metrics, meta=meta_out, current_round=msg.current_round))
        except Exception as e:  # noqa: BLE001 - reported to the server by name, never silently
            # an unreadable image is reported as the ImageReadError (file, reason, manifest line), not as the
            # transform wrapper MONAI raises around it
            reason = f"site {site}: task {task} failed: {describe_error(e)}"
            log.error("%s\n%s", reason, traceback.format_exc())
            # the server gets the reason without file paths / image names (they stay in this site's log)
            flare.send(FLModel(params={}, metrics={}, meta={"status": "error", "error": redact_paths(reason)},
                               current_round=msg.current_round))
        finally:
            beat.end_task()
    beat.stop()


if __name__ == "__main__":
    main()
