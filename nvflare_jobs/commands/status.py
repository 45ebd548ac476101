"""``cxr-hfl status`` (one live view of a job) and ``cxr-hfl results`` (a production job's results).

``status RUN_DIR`` reads a simulator run folder; ``status JOB_ID --startup-kit KIT`` asks a POC or provisioned
server through NVFlare's admin API with the caller's own startup kit (the coordinator's, in this consortium:
hospitals have no admin identity). ``results JOB_ID --startup-kit KIT`` downloads a finished job and writes the
simulator's run layout (metrics.json, plots) with the job id and status. ``submit`` checks a job folder and that every
site it expects is connected, then submits it; ``abort`` stops a job. See docs/DEPLOYMENT.md.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def watch_seconds(text: str) -> float:
    """argparse type of ``--watch``: a finite number of seconds > 0."""
    import argparse
    import math

    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text}")
    return v


def register(sub) -> None:
    p = sub.add_parser("status", help="one view of a job: state, round/task, every site (simulator run folder, "
                                      "or a POC/provisioned job through NVFlare's admin API)")
    p.add_argument("target", help="a simulator run folder (cxr-hfl simulate --out), or a job id with --startup-kit")
    _kit_args(p)
    p.add_argument("--watch", type=watch_seconds, nargs="?", const=5.0, metavar="SECONDS",
                   help="refresh every SECONDS (default 5) until the job ends (Ctrl-C to stop watching)")
    p.add_argument("--json", action="store_true", help="print the view as JSON (one object per refresh)")
    p.set_defaults(func=run_status)
    r = sub.add_parser("results", help="download a finished POC/provisioned job and write metrics.json + plots "
                                       "(as cxr-hfl simulate), with the job id and status")
    r.add_argument("job_id")
    _kit_args(r)
    r.add_argument("--out", required=True, help="run folder to write (metrics.json, sites.csv, plots)")
    from nvflare_jobs.commands.simulate import at_least

    r.add_argument("--wait", type=at_least(0), default=0, metavar="SECONDS",
                   help="first wait up to SECONDS for the job (default 0: do not wait)")
    r.set_defaults(func=run_results)
    q = sub.add_parser("submit", help="check an exported (or edited) job folder as the server will, then submit it "
                                      "with your startup kit (production; POC: cxr-hfl poc submit)")
    q.add_argument("--job", "-j", required=True, help="job folder written by cxr-hfl export-job")
    _kit_args(q)
    add_override(q)
    q.set_defaults(func=run_submit)
    a = sub.add_parser("abort", help="abort a POC/provisioned job: a running job stops, a queued one never starts")
    a.add_argument("job_id")
    _kit_args(a)
    a.set_defaults(func=run_abort)


def add_override(p) -> None:
    """``--allow-missing-sites``: the override of submit's connected-site check (``cxr-hfl submit`` and ``poc
    submit``)."""
    p.add_argument("--allow-missing-sites", action="store_true",
                   help="submit even when some sites the job expects are not connected (heard from within twice "
                        "the 10 s heartbeat interval): NVFlare then deploys it to the connected sites only, and "
                        "the job records the others as not deployed (default: refuse, naming them)")


def _kit_args(p) -> None:
    p.add_argument("--startup-kit", metavar="KIT", help="your admin startup kit folder (the coordinator's kit of "
                                                        "cxr-hfl provision; POC: see cxr-hfl poc status; default: none)")
    p.add_argument("--user", help="the kit's admin name (default: the kit folder's name)")


def _session(args):
    kit = Path(args.startup_kit or "")
    if not args.startup_kit:
        print(f"cxr-hfl {args.command}: --startup-kit KIT is required: your admin startup kit folder (the "
              "coordinator's kit of cxr-hfl provision; POC: see cxr-hfl poc status)", file=sys.stderr)
        raise SystemExit(2)
    if not (kit / "startup" / "fed_admin.json").is_file():  # a server or site kit holds fed_server/fed_client.json
        print(f"cxr-hfl {args.command}: --startup-kit {kit} is not an admin startup kit (no startup/fed_admin.json)",
              file=sys.stderr)
        raise SystemExit(2)
    try:
        return open_session(args.user or kit.resolve().name, kit.resolve(), 30, quiet=getattr(args, "json", False))
    except Exception as e:  # noqa: BLE001 - NVFlare raises many kinds; one line for the user
        print(f"cxr-hfl {args.command}: cannot reach the server with {kit}: {type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(1) from None


def open_session(user: str, kit: str | Path, timeout: float, quiet: bool = False):
    """NVFlare's admin session (``flare_api.new_secure_session``) with the startup kit ``kit``. NVFlare prints
    ``Connecting to FLARE ...`` on stdout; ``quiet`` (``--json``) sends it to stderr, so stdout holds only JSON."""
    import contextlib

    from nvflare.fuel.flare_api.flare_api import new_secure_session

    with contextlib.redirect_stdout(sys.stderr) if quiet else contextlib.nullcontext():
        return new_secure_session(user, str(kit), timeout=timeout)


def show(view_fn, as_json: bool, watch: float | None, stream=None) -> dict:
    """Print ``view_fn()`` once, or every ``watch`` seconds until the job is finished; returns the last view."""
    import contextlib

    from nvflare_jobs.status import format_view

    stream = stream or sys.stdout
    while True:
        with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
            v = view_fn()  # NVFlare's admin calls may print; with --json stdout holds only the view
        print(json.dumps(v, default=str) if as_json else format_view(v), file=stream, flush=True)
        if not watch or str(v.get("job_state", "")).upper().startswith(("FINISHED", "STOPPED", "ABORTED")):
            return v
        time.sleep(watch)
        if not as_json:
            print("", file=stream)


def run_status(args) -> int:
    target = Path(args.target)
    if target.is_dir():
        from nvflare_jobs.status import run_folder_view

        try:
            v = show(lambda: run_folder_view(target), args.json, args.watch)
        except FileNotFoundError as e:
            print(f"cxr-hfl status: {e}", file=sys.stderr)
            return 2
        return 1 if "FAILED" in str(v.get("job_state")) else 0
    if not args.startup_kit:
        print(f"cxr-hfl status: {args.target} is not a run folder; for a POC/provisioned job give its id with "
              "--startup-kit KIT (or use cxr-hfl poc status)", file=sys.stderr)
        return 2
    from nvflare_jobs.status import admin_view

    sess = _session(args)
    try:
        v = show(lambda: admin_view(sess, args.target), args.json, args.watch)
    finally:
        sess.close()
    return 0 if "FAILED" not in str(v.get("job_state")) and "ABNORMAL" not in str(v.get("job_state")) else 1


def run_submit(args) -> int:
    from nvflare_jobs.deploy import DeployError, check_job_folder

    try:
        check_job_folder(args.job)
    except DeployError as e:
        print(f"cxr-hfl submit: {e}; nothing was submitted", file=sys.stderr)
        return 2
    from nvflare_jobs.deploy import check_connected
    from nvflare_jobs.status import heard_sites

    meta = json.loads((Path(args.job) / "meta.json").read_text())
    sess = _session(args)
    try:
        try:  # every site the job expects connected now, unless --allow-missing-sites
            warnings = check_connected(Path(args.job).name, meta, heard_sites(sess), args.allow_missing_sites)
        except DeployError as e:
            print(f"cxr-hfl submit: {e}", file=sys.stderr)
            return 1
        for w in warnings:
            print(w, file=sys.stderr)
        job_id = sess.submit_job(str(Path(args.job).resolve()))
    finally:
        sess.close()
    kit = args.startup_kit
    print(f"[cxr-hfl] submitted {Path(args.job).name}: job id {job_id}")
    print(f"watch it:  cxr-hfl status {job_id} --startup-kit {kit} --watch")
    print(f"results:   cxr-hfl results {job_id} --startup-kit {kit} --out runs/{job_id} --wait 3600")
    return 0


def run_abort(args) -> int:
    """``cxr-hfl abort JOB --startup-kit KIT``: NVFlare's ``abort_job`` (a running job stops; a queued one is
    never scheduled); then the job's status. Returns 0 once the server accepted the abort, else 1."""
    sess = _session(args)
    try:
        try:
            answer = sess.abort_job(args.job_id)
        except Exception as e:  # noqa: BLE001 - NVFlare raises many kinds (unknown job, already finished)
            print(f"cxr-hfl abort: job {args.job_id}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        status = str((sess.get_job_meta(args.job_id) or {}).get("status") or "unknown")
    finally:
        sess.close()
    print(f"[cxr-hfl] abort of job {args.job_id} sent: {answer or 'accepted'}; its status now: {status}")
    return 0


def run_results(args) -> int:
    from nvflare_jobs.deploy import assemble_downloaded

    sess = _session(args)
    try:
        if args.wait:
            sess.monitor_job(args.job_id, timeout=args.wait)
        meta = sess.get_job_meta(args.job_id) or {}
        status = str(meta.get("status") or "")
        if not status.startswith("FINISHED"):
            print(f"cxr-hfl results: job {args.job_id} is {status or 'unknown'}; wait for it (--wait SECONDS or "
                  "cxr-hfl status --watch)", file=sys.stderr)
            return 1
        dl = Path(args.out).resolve() / "download"
        dl.mkdir(parents=True, exist_ok=True)
        path = _download(sess, args.job_id, dl)
    finally:
        sess.close()
    meta = {**meta, "job_id": args.job_id}
    return report_downloaded(path, meta, lambda: assemble_downloaded(path, Path(args.out).resolve(), job_meta=meta))


def _download(sess, job_id: str, dest: Path) -> Path:
    """``Session.download_job_result`` writes into the kit's download folder; move the job there into ``dest``."""
    import shutil

    src = Path(sess.download_job_result(job_id))
    target = dest / job_id
    if target.exists():
        shutil.rmtree(target)
    shutil.move(str(src), str(target))
    return target


def report_downloaded(download: Path, meta: dict, assemble) -> int:
    """Print a downloaded job's status and, when the run failed, its reason; unless it failed before any site
    finished (then nothing is written: no empty metrics.json or plots), ``assemble()`` writes the run folder
    (returns its metrics with ``run_dir``) and every expected site's part in the job (``status.site_truth``:
    took part with its test metrics and decision, excluded, not deployed) and the findings (``run_findings``) are
    printed.
    Returns 0 for a completed run, else 1."""
    from nvflare_jobs.deploy import run_findings
    from nvflare_jobs.results import find_server_results

    status = str(meta.get("status") or "")
    try:
        rec = json.loads(find_server_results(download).read_text())
    except FileNotFoundError:
        rec = None
    if rec is None or (rec.get("failed") and not rec.get("sites") and not rec.get("cross_site")):
        reason = (rec or {}).get("failed") or "the server wrote no results (see its log in the download)"
        print(f"[cxr-hfl] job {meta.get('job_id')}: {status}: {reason}", file=sys.stderr)
        print(f"  downloaded to {download}; no metrics.json written (no site finished)", file=sys.stderr)
        return 1
    from nvflare_jobs.status import format_site, site_truth

    m = assemble()
    print(f"[cxr-hfl] job {meta.get('job_id')} ({status}) -> {Path(m['run_dir']) / 'metrics.json'}")
    if rec.get("failed"):
        print(f"  FAILED: {rec['failed']}")
    for site, t in site_truth(m).items():  # every expected site: took part / excluded / not deployed / missing
        print("  " + format_site(site, t))
    for site, row in sorted((m.get("cross_site") or {}).items()):  # a cross-site evaluation job
        print(f"  {site:<12} " + "  ".join(
            f"{name}: " + (f"refused ({v['refused']})" if "refused" in v else
                           f"bal. acc. {v.get('balanced_accuracy') or 0:.3f}, AUC {v.get('auc') or 0:.3f}")
            for name, v in row.items()))
    for line in run_findings(m):
        print(line)
    if m.get("tensorboard"):
        print(f"  TensorBoard: tensorboard --logdir {m['tensorboard']}")
    if m.get("mlflow"):
        print(f"  MLflow store: {m['mlflow']} (mlflow ui --backend-store-uri {m['mlflow']})")
    return 0 if status.endswith("COMPLETED") and not rec.get("failed") else 1
