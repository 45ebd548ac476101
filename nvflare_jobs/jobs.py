"""Build an NVFlare ``FedJob`` for each method from a site-config profile.

The same job object runs in the simulator (``job.simulator_run``) and is exported (``job.export_job``) to a folder
that ``nvflare job submit -j`` accepts. The job carries no hospital's paths: every site runs the same Client API
script and finds its own config locally by site name (``nvflare_jobs.site_config``). The platform package
(``cxr-hfl``, pinned dependencies) is installed at every site and on the server, so hospital IT can review one
pinned version; the job ships only the site script.
"""
from __future__ import annotations

from pathlib import Path

from hfl_components.models import DEPTH_ORDER, is_fusable

METHODS = ("local", "fedavg", "ohfl", "fedsaf", "fedproto", "fedtopo")
SITE_SCRIPT = Path(__file__).resolve().parent.parent / "hfl_components" / "flare" / "site_script.py"


def deepest_spec(profile: dict[str, dict]) -> dict:
    """The deepest (then widest) fusable model spec of a profile: FedAvg's one architecture (OHFL Sec. 4.3)."""
    specs = [cfg["model"] for cfg in profile.values() if is_fusable(cfg["model"])]
    if not specs:
        raise ValueError("FedAvg needs at least one fusable (cnn/vgg11) model spec in the profile")
    return dict(max(specs, key=lambda s: (DEPTH_ORDER.get(s.get("depth", "shallow"), 0),
                                          float(s.get("width", 1.0)))))


def make_controller(method: str, profile: dict[str, dict], opts: dict):
    """Instantiate the server workflow for ``method`` with options ``opts`` (see ``cxr-hfl simulate --help``)."""
    from hfl_components.flare import controllers as C

    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known: {METHODS}")
    n = len(profile)
    common = {"num_rounds": int(opts.get("rounds", 1)), "min_sites": int(opts.get("min_sites") or max(1, n - 1)),
              "task_timeout": int(opts.get("task_timeout", 0)), "seed": int(opts.get("seed", 0)),
              "late_wait_s": None if opts.get("late_wait_s") is None else int(opts["late_wait_s"])}
    tc = {k: opts[k] for k in ("local_epochs", "finetune_epochs", "finetune_lr") if opts.get(k) is not None}
    num_classes = next(iter(profile.values()))["model"]["num_classes"]
    if method == "local":
        return C.LocalController(task_config=tc, **common)
    if method == "fedavg":
        return C.FedAvgController(global_spec=deepest_spec(profile), task_config=tc, **common)
    if method == "ohfl":
        for site, cfg in profile.items():
            if not is_fusable(cfg["model"]):
                raise ValueError(f"OHFL needs fusable cnn/vgg11 models; site {site} has {cfg['model']}")
        if not opts.get("probe"):
            raise ValueError("OHFL needs a probe set of public images for CKA (--probe DIR or --probe generated)")
        common["num_rounds"] = 1
        return C.OHFLController(probe=str(opts["probe"]), strategy=opts.get("strategy", "cid"),
                                alignment=opts.get("alignment", "cka"), ot_solver=opts.get("ot", "emd"),
                                ground_metric=opts.get("ground_metric", "acts"),
                                probe_size=int(opts.get("probe_size", 64)), weighting=opts.get("weighting", "samples"),
                                repair=opts.get("repair", "layer"), cka=opts.get("cka", "linear"),
                                probe_at=opts.get("probe_at", "largest"),
                                fusion_device=opts.get("server_device") or "auto",
                                task_config={**tc, "init": opts.get("init", "site"), "init_seed": common["seed"],
                                             "gate": bool(opts.get("gate", True))}, **common)
    if method in ("fedsaf", "fedproto"):
        dims = {cfg["model"].get("feature_dim") for cfg in profile.values()}
        if len(dims) != 1 or None in dims:
            raise ValueError(f"FedSAF needs one common feature_dim in every site's model spec, got {dims}")
        # --method fedproto is shorthand for the coordinate (MSE) alignment with FedProto's weighted-mean prototypes,
        # run through the same two-level framework as FedSAF (the paper's "Ours-MSE"; issue 5).
        alignment = "mse" if method == "fedproto" else (opts.get("alignment") or "gcsa")
        if alignment not in ("gcsa", "rcsa", "mse", "cosine"):
            raise ValueError(f"FedSAF alignment must be gcsa, rcsa, mse or cosine, got {alignment!r}")
        prototypes = "fedproto" if method == "fedproto" else (opts.get("prototypes") or "fedproto")
        if prototypes not in ("fedproto", "fixed", "tgp"):
            raise ValueError(f"FedSAF prototypes must be fedproto, fixed or tgp, got {prototypes!r}")
        ev = opts.get("eval") or "head"
        if ev not in ("head", "nearest-prototype"):
            raise ValueError(f"FedSAF evaluation must be 'head' or 'nearest-prototype' (the site's own local "
                             f"prototypes; nearest-global is not offered), got {ev!r}")
        tc.update({"alignment": alignment, "lambda": float(_opt(opts, "lam", 1.0)),
                   "gamma": float(_opt(opts, "gamma", 1.0)), "eval": ev})
        return C.FedSAFController(num_classes=num_classes, feature_dim=int(dims.pop()), prototypes=prototypes,
                                  task_config=tc, method_name=method, **common)
    # fedtopo
    from hfl_components.topology import TopologyAblation

    ablate = sorted(set(opts.get("ablate") or []))
    TopologyAblation.from_names(ablate)  # ValueError on an unknown switch
    if (opts.get("eval") or "head") != "head":
        raise ValueError("FedTopo evaluates with the site's own head only (--eval nearest-prototype is FedSAF's)")
    rho = float(_opt(opts, "rho", 0.7))
    if not 0.0 <= rho < 1.0:
        raise ValueError(f"rho must lie in [0, 1), got {rho}")
    noisy = opts.get("noisy_counts")
    if noisy is not None and float(noisy) < 0:
        raise ValueError(f"noisy-counts scale must be >= 0, got {noisy}")
    tc.update({"lambda": float(_opt(opts, "lam", 1.0)), "gamma": float(_opt(opts, "gamma", 1.0)),
               "top_q": int(_opt(opts, "top_q", 3)), "warmup": int(_opt(opts, "warmup", 3)), "ablate": ablate,
               "noisy_counts": None if noisy is None else float(noisy)})
    return C.FedTopoController(num_classes=num_classes, rho=rho, ablate=ablate, task_config=tc, **common)


def _opt(opts: dict, key: str, default):
    """``opts[key]`` unless missing or None."""
    v = opts.get(key)
    return default if v is None else v


def build_job(method: str, profile: dict[str, dict], opts: dict):
    """A ``FedJob`` named ``cxr_hfl_<method>``: the method's controller on the server, the site script at every
    site of the profile (one ``to(..., site)`` per site; sites are the profile's file names)."""
    from nvflare.job_config.api import FedJob
    from nvflare.job_config.script_runner import FrameworkType, ScriptRunner

    ctl = make_controller(method, profile, opts)
    job = FedJob(name=f"cxr_hfl_{method}", min_clients=ctl.min_sites)
    job.to_server(ctl)
    from nvflare.apis.analytix import ANALYTIC_EVENT_TYPE
    from nvflare.app_common.widgets.convert_to_fed_event import ConvertToFedEvent

    for site in profile:
        job.to(ScriptRunner(script=str(SITE_SCRIPT), framework=FrameworkType.RAW), site)
        # the site's progress heartbeats (flare.log) reach the server as fed events (liveness + live progress)
        job.to(ConvertToFedEvent(events_to_convert=[ANALYTIC_EVENT_TYPE]), site, id="progress_to_server")
    return job
