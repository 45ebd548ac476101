"""Build an NVFlare ``FedJob`` for each method from a site-config profile.

The same job object runs in the simulator (``job.simulator_run``) and is exported (``job.export_job``) to a folder
that ``nvflare job submit -j`` accepts. The job carries no hospital's paths: every site runs the same Client API
script and finds its own config locally by site name (``hfl_components.flare.site_config``). The platform package
(``cxr-hfl``, pinned dependencies) is installed at every site and on the server, so hospital IT can review one
pinned version; the job ships only the site script.
"""
from __future__ import annotations

from pathlib import Path


SITE_SCRIPT = Path(__file__).resolve().parent.parent / "hfl_components" / "flare" / "site_script.py"
# Seconds the server tells a site to wait before asking for its next task (NVFlare's server config
# ``server.task_request_interval``, default 2 s). Every round starts when the slowest site next asks, so the 2 s
# default cost up to 2 s per round boundary (studies/speed/RESULTS.md); 0.5 s is NVFlare's own client-side
# default.
TASK_REQUEST_INTERVAL_S = 0.5


class ServerParams:
    """Extra server configuration of a job (``config_fed_server.json`` top level), added through NVFlare's
    ``add_to_fed_job`` hook: ``job.to_server(ServerParams({"server": {"task_request_interval": 0.5}}))``."""

    def __init__(self, params: dict):
        self.params = params

    def add_to_fed_job(self, job, ctx, **kwargs):
        job.add_params(self.params, ctx)


# how a controller finds its catalogue entry (its options' declarations, upload checks, training task): given to
# every controller by the job, since the catalogue names the controllers and they must not import it back
ENTRY_REF = "hfl_components.flare.catalogue:entry"


def make_controller(method: str, profile: dict[str, dict], opts: dict):
    """Instantiate the server workflow for ``method`` with options ``opts`` (see ``cxr-hfl simulate --help``).

    The method's catalogue entry (``hfl_components.flare.catalogue``) names the controller; its options are checked
    once here by ``catalogue.validate_options`` and the controller class builds itself with ``from_options``.

    Raises:
        ValueError: unknown method, a bad option (naming it), or a profile the method cannot run.
    """
    from hfl_components.flare.catalogue import entry, validate_options
    from hfl_components.flare.options import resolve

    e = entry(method)
    checked = validate_options(method, opts)
    n = len(profile)
    common = {"num_rounds": int(opts.get("rounds") or 1), "min_sites": int(opts.get("min_sites") or max(1, n - 1)),
              "task_timeout": int(opts.get("task_timeout") or 0), "seed": int(opts.get("seed") or 0),
              "late_wait_s": None if opts.get("late_wait_s") is None else int(opts["late_wait_s"]),
              "entry_ref": ENTRY_REF}
    tc = {k: opts[k] for k in ("local_epochs", "finetune_epochs", "finetune_lr") if opts.get(k) is not None}
    return resolve(e.controller).from_options(method, profile, checked, common, tc)


TRACKING = ("tensorboard", "mlflow", "none")
TB_FOLDER = "tb_events"  # <server run dir>/tb_events/<site>/events.out.tfevents.* (NVFlare's TBAnalyticsReceiver)
MLFLOW_EXTRA = "cxr-hfl[mlflow]"


def tracking_receivers(tracking: str = "tensorboard", tracking_uri: str | None = None) -> list:
    """The server components for ``tracking``: NVFlare's ``TBAnalyticsReceiver`` (unless ``none``), plus its
    ``MLflowReceiver`` for ``mlflow`` (a local SQLite store unless ``tracking_uri``).

    Raises:
        ValueError: an unknown choice, ``tracking_uri`` without mlflow, or mlflow asked for without the
            ``cxr-hfl[mlflow]`` extra installed (naming the extra).
    """
    if tracking not in TRACKING:
        raise ValueError(f"--tracking {tracking!r}: choose one of {', '.join(TRACKING)}")
    if tracking_uri and tracking != "mlflow":
        raise ValueError("--tracking-uri is an MLflow setting: add --tracking mlflow")
    if tracking == "none":
        return []
    from nvflare.app_opt.tracking.tb.tb_receiver import TBAnalyticsReceiver

    out = [TBAnalyticsReceiver(tb_folder=TB_FOLDER)]
    if tracking == "mlflow":
        import importlib.util

        if any(importlib.util.find_spec(m) is None for m in ("mlflow", "alembic", "sqlalchemy")):
            raise ValueError(f"--tracking mlflow needs MLflow on the server: pip install '{MLFLOW_EXTRA}' "
                             "(the pinned mlflow-skinny and its SQLite store)")
        from nvflare.app_opt.tracking.mlflow.mlflow_receiver import MLflowReceiver

        out.append(MLflowReceiver(tracking_uri=tracking_uri,
                                  kw_args={"experiment_name": "cxr-hfl", "run_name": "cxr-hfl"}))
    return out


def build_job(method: str, profile: dict[str, dict], opts: dict, tracking: str = "tensorboard",
              tracking_uri: str | None = None):
    """A ``FedJob`` named ``cxr_hfl_<method>``: the method's controller on the server, the site script at every
    site of the profile (one ``to(..., site)`` per site; sites are the profile's file names), and the tracking
    receivers of :func:`tracking_receivers` on the server. Raises ValueError as ``make_controller`` and
    ``tracking_receivers`` do."""
    from nvflare.job_config.api import FedJob
    from nvflare.job_config.script_runner import FrameworkType, ScriptRunner

    ctl = make_controller(method, profile, opts)
    receivers = tracking_receivers(tracking, tracking_uri)
    from hfl_components.flare.participation import EXPECTED_SITES_KEY

    job = FedJob(name=f"cxr_hfl_{method}", min_clients=ctl.min_sites,
                 meta_props={EXPECTED_SITES_KEY: sorted(profile)})  # "missing" is computable at the server
    job.to_server(ctl)
    job.to_server(ServerParams({"server": {"task_request_interval": TASK_REQUEST_INTERVAL_S}}))
    for i, r in enumerate(receivers):
        job.to_server(r, id=("tb_receiver", "mlflow_receiver")[i])
    from nvflare.apis.analytix import ANALYTIC_EVENT_TYPE
    from nvflare.app_common.widgets.convert_to_fed_event import ConvertToFedEvent

    for site in profile:
        job.to(ScriptRunner(script=str(SITE_SCRIPT), framework=FrameworkType.RAW), site)
        # the site's progress heartbeats (flare.log) reach the server as fed events (liveness + live progress)
        job.to(ConvertToFedEvent(events_to_convert=[ANALYTIC_EVENT_TYPE]), site, id="progress_to_server")
    return job
