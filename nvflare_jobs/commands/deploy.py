"""``cxr-hfl provision`` (NVFlare startup kits for the consortium) and ``cxr-hfl poc ...`` (a local consortium).

See docs/DEPLOYMENT.md for the coordinator's and the hospital operator's walk-through.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

POC_ENV = "CXR_HFL_POC_DIR"


def register(sub) -> None:
    from nvflare_jobs.commands.simulate import at_least
    from nvflare_jobs.commands.status import add_override, watch_seconds

    p = sub.add_parser("provision", help="run NVFlare provisioning: one startup kit per server/hospital/admin")
    p.add_argument("--project", help="NVFlare project.yml (default: site_configs/project.yml of this repository)")
    p.add_argument("--out", required=True, help="folder for the startup kits (keep it outside any repository: "
                                                "OUT/<project>/state/ holds the root CA's private key)")
    p.add_argument("--job-store", metavar="DIR",
                   help="absolute folder on the server machine for its job store and snapshots (default "
                        "/var/lib/cxr-hfl/<project>; NVFlare's own default is the system temp folder)")
    p.set_defaults(func=run_provision)

    poc = sub.add_parser("poc", help="a local proof-of-concept consortium (nvflare poc) named after a profile")
    psub = poc.add_subparsers(dest="poc_command", metavar="ACTION")

    def add(name, help_, func):
        q = psub.add_parser(name, help=help_)
        q.add_argument("--workspace", "-w", default=os.environ.get(POC_ENV),
                       help=f"the POC folder (required; default ${POC_ENV}); NVFlare's state and a private HOME live "
                            "inside it, never in your home folder")
        q.set_defaults(func=func)
        return q

    q = add("prepare", "provision the POC consortium and place each site's config in its local/cxr_hfl/", run_prepare)
    q.add_argument("--profile", required=True, help="folder of <site>.yaml site configs; the sites are its file names")
    q.add_argument("--project", help="project.yml whose coordinator role/orgs to use (default site_configs/project.yml)")
    q.add_argument("--no-site-check", action="store_true",
                   help="do not run `cxr-hfl site check` for every site (configs are still validated)")
    q.add_argument("--allow-site-errors", action="store_true",
                   help="prepare even when sites have problems (to rehearse how a failing site is reported)")
    q = add("start", "start the POC server and sites (returns when the sites are connected)", run_start)
    q.add_argument("--timeout", type=at_least(1), default=120, metavar="SECONDS",
                   help="wait up to SECONDS for the server and sites to start (default 120)")
    q = add("submit", "submit an exported job folder as the coordinator", run_submit)
    q.add_argument("--job", "-j", required=True, help="job folder written by `cxr-hfl export-job` (OUT/<job name>)")
    q.add_argument("--wait", type=at_least(0), default=0, metavar="SECONDS",
                   help="wait up to SECONDS for the job to finish (default 0: return once submitted)")
    add_override(q)
    q = add("abort", "abort a job: a running job stops, a queued one never starts", run_abort)
    q.add_argument("job_id", nargs="?", help="a job id (default: the last job submitted to this POC)")
    q = add("status", "POC processes, the jobs on the server and the status view of a job (cxr-hfl status)",
            run_status)
    q.add_argument("job_id", nargs="?", help="a job id (default: the last job submitted from this POC folder)")
    q.add_argument("--json", action="store_true", help="the job's status view as JSON")
    q.add_argument("--watch", type=watch_seconds, nargs="?", const=5.0, metavar="SECONDS",
                   help="refresh the job's view every SECONDS (default 5) until it ends")
    q = add("download", "download a job's results and write metrics.json + plots (as `cxr-hfl simulate`)",
            run_download)
    q.add_argument("job_id", nargs="?", help="job id (default: the last job submitted from this POC folder)")
    q.add_argument("--out", help="run folder (default WORKSPACE/runs/<job id>)")
    q.add_argument("--wait", type=at_least(0), default=0, metavar="SECONDS",
                   help="first wait up to SECONDS for the job (default 0: do not wait)")
    add("stop", "stop the POC and end any of its processes still running", run_stop)
    poc.set_defaults(func=lambda a: (poc.print_help(), 2)[1])


def _poc(args):
    from nvflare_jobs.deploy import Poc

    if not args.workspace:
        print(f"cxr-hfl poc: --workspace DIR is required (or set ${POC_ENV}); NVFlare's POC state goes there",
              file=sys.stderr)
        raise SystemExit(2)
    ws = Path(args.workspace)
    if ws.exists() and not ws.is_dir():
        print(f"cxr-hfl poc: --workspace {ws} is a file, not a folder", file=sys.stderr)
        raise SystemExit(2)
    return Poc(args.workspace)


def _guard(fn):
    def wrapped(args):
        from nvflare_jobs.deploy import DeployError
        from hfl_components.flare.site_config import SiteConfigError

        try:
            return fn(args)
        except (DeployError, SiteConfigError, FileNotFoundError) as e:
            print(f"cxr-hfl: {e}", file=sys.stderr)
            return 1
    return wrapped


@_guard
def run_provision(args) -> int:
    from nvflare_jobs.deploy import provision

    if Path(args.out).exists() and not Path(args.out).is_dir():
        print(f"cxr-hfl provision: --out {args.out} is a file, not a folder", file=sys.stderr)
        return 2
    from nvflare_jobs.deploy import DeployError, load_project

    try:  # a missing or malformed project file is bad input (exit 2), refused before anything is written
        load_project(args.project)
    except DeployError as e:
        print(f"cxr-hfl provision: {e}", file=sys.stderr)
        return 2
    res = provision(args.project, args.out, job_store=args.job_store)
    print(f"[cxr-hfl] provisioned {res['project']} -> {res['prod_dir']}")
    print(f"CA state (root CA private key): {res['state_dir']} (mode 600): move it offline now; it is needed only "
          "to add a participant or renew certificates (docs/DEPLOYMENT.md, Certificates)")
    print(f"server job store: {res['job_store']} (on the server machine; --job-store DIR to change)")
    print("hospital kits: log streaming to the server is off (local/resources.json)")
    print("Give each participant ONLY its own kit (it holds that participant's private key):")
    for k in res["kits"]:
        who = {"server": "server operator", "client": f"hospital {k['name']} ({k['org']})",
               "admin": f"coordinator {k['name']} (role {k['role']})"}[k["type"]]
        print(f"  {who:<48} kit: {k['kit']}")
    print("Each participant runs, in the folder where it unpacked its kit:")
    for k in res["kits"]:
        n = k["name"]
        if k["type"] == "client":
            print(f"  {n:<40} bash {n}/startup/start.sh   (site config: {n}/local/cxr_hfl/{n}.yaml)")
        elif k["type"] == "server":
            print(f"  {'server':<40} bash {n}/startup/start.sh")
        else:
            print(f"  {n:<40} cxr-hfl submit --job JOB --startup-kit {n}")
    return 0


@_guard
def run_prepare(args) -> int:
    poc = _poc(args)

    def report(site, r):
        n = r.get("n_images")
        bad = len(r.get("unreadable") or [])
        print(f"  site check {site:<12} {'FAILED' if r['errors'] else 'OK':<6} "
              + (f"{n} images, {bad} unreadable, " if n is not None else "")
              + f"{len(r['errors'])} errors, {len(r['warnings'])} warnings")

    if not args.no_site_check:
        print("[cxr-hfl] checking every site (config, manifest, every image, model, device)")
    st = poc.prepare(args.profile, args.project, site_check=not args.no_site_check,
                     allow_site_errors=args.allow_site_errors, report=report)
    for p in getattr(poc, "problems", []):
        print(f"  WARNING (--allow-site-errors): {p}")
    print(f"[cxr-hfl] POC prepared in {poc.dir} (NVFlare workspace {st['nvflare_poc_workspace']})")
    for site in st["sites"]:
        print(f"  {site}: workspace {poc.site_workspace(site)}; config {poc.site_workspace(site)}/local/cxr_hfl/{site}.yaml")
    print(f"  coordinator {st['coordinator']} (role {st['coordinator_role']}), kit {st['admin_kit']}")
    print(f"next: cxr-hfl poc start --workspace {poc.dir}")
    return 0


@_guard
def run_start(args) -> int:
    poc = _poc(args)
    try:
        poc.start(timeout=args.timeout)
    except KeyboardInterrupt:
        left = poc.own_pids()
        print(f"cxr-hfl poc start: interrupted; the POC's server and sites were stopped"
              + (f" except {left}" if left else ""), file=sys.stderr)
        raise
    print(f"[cxr-hfl] POC running; sites {', '.join(poc.state()['sites'])}; logs under {poc.prod_dir}/<site>/")
    print(f"submit a job with: cxr-hfl poc submit --workspace {poc.dir} --job <job_folder> [--wait SECONDS]")
    print(f"  or as in production: {poc.submit_hint()}")
    return 0


@_guard
def run_submit(args) -> int:
    poc = _poc(args)
    job_id = poc.submit(args.job, allow_missing=args.allow_missing_sites)
    for w in poc.warnings:
        print(w, file=sys.stderr)
    print(f"[cxr-hfl] submitted {Path(args.job).name} as {poc.state()['coordinator']}: job id {job_id}")
    if args.wait:
        data = poc.wait(job_id, timeout=args.wait)
        status = str(data.get("status", ""))
        print(f"[cxr-hfl] job {job_id}: {status}")
        if status.startswith("FINISHED"):
            return max(_report_run(poc, job_id, None), 0 if status.endswith("COMPLETED") else 1)
        return 1
    print(f"wait and fetch the results with: cxr-hfl poc download --workspace {poc.dir} {job_id} --wait 600")
    return 0


def _report_run(poc, job_id: str, out) -> int:
    """Download the job; print its status, the reason of a failed run, per-site metrics, the sites left out and
    warnings; write the run folder (none for a job that failed before any site finished). Returns 0 / 1."""
    from nvflare_jobs.commands.status import report_downloaded

    path, meta = poc.download_raw(job_id)
    return report_downloaded(path, {**meta, "job_id": job_id}, lambda: poc.assemble(job_id, path, out, meta)[1])


@_guard
def run_status(args) -> int:
    import json

    from nvflare_jobs.deploy import DeployError

    poc = _poc(args)
    st = poc.state()
    pids = poc.own_pids()
    say = sys.stderr if args.json else sys.stdout  # --json: stdout holds only the view's JSON, for scripts
    if poc.server_up():
        print(f"[cxr-hfl] POC {poc.dir}: running ({len(pids)} processes); sites {', '.join(st['sites'])}", file=say)
    else:  # --json: one object on stdout in every case
        state = "not running" if pids else "stopped"
        print(f"[cxr-hfl] POC {poc.dir}: {state}" + (f": {poc.server_state()}" if pids else "")
              + f"; sites {', '.join(st['sites'])}", file=say)
        if args.json:
            print(json.dumps({"poc": str(poc.dir), "state": state, "sites": st["sites"], "jobs": []}))
        return 1 if pids else 0
    if not args.job_id:
        for j in poc.list_jobs():
            print(f"  {j.get('job_id')}  {j.get('name', j.get('job_name', '')):<20} {j.get('status')}", file=say)
    try:  # the last job submitted from this folder, else the newest on the server (cxr-hfl submit, nvflare job)
        job_id = args.job_id or poc.last_job()
    except DeployError:
        job_id = None
    if not job_id:
        print(json.dumps({"poc": str(poc.dir), "state": "running", "jobs": []}) if args.json else
              "  no job on the server yet", file=sys.stdout)
    else:
        from nvflare_jobs.commands.status import open_session, show
        from nvflare_jobs.status import admin_view

        sess = open_session(st["coordinator"], st["admin_kit"], 60, quiet=args.json)
        try:
            show(lambda: admin_view(sess, job_id), args.json, args.watch)
        finally:
            sess.close()
    return 0


@_guard
def run_download(args) -> int:
    poc = _poc(args)
    job_id = args.job_id or poc.last_job()
    if args.wait:
        poc.wait(job_id, timeout=args.wait)
    return _report_run(poc, job_id, args.out)


@_guard
def run_abort(args) -> int:
    poc = _poc(args)
    job_id = args.job_id or poc.last_job()
    answer = poc.abort(job_id)
    print(f"[cxr-hfl] abort of job {job_id} sent: {answer}")
    print(f"its status: cxr-hfl poc status --workspace {poc.dir} {job_id}")
    return 0


@_guard
def run_stop(args) -> int:
    poc = _poc(args)
    poc.state()
    if not poc.own_pids():
        print(f"[cxr-hfl] POC in {poc.dir} already stopped")
        return 0
    try:
        killed = poc.stop()
    except KeyboardInterrupt:  # the start scripts' loops are not our children: say what still runs
        left = poc.end_now()
        print(f"cxr-hfl poc stop: interrupted; " + (f"STILL RUNNING: {left}; run `cxr-hfl poc stop --workspace "
                                                    f"{poc.dir}` again" if left else
                                                    "every process of the POC ended"), file=sys.stderr)
        return 130
    left = poc.own_pids()
    print(f"[cxr-hfl] POC in {poc.dir} stopped" + (f"; ended leftover processes {killed}" if killed else "")
          + (f"; STILL RUNNING: {left}" if left else ""))
    return 1 if left else 0
