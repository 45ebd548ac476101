"""Cross-site evaluation of model files as an NVFlare job (``cxr-hfl export-eval``), and the same scoring locally.

The job's server app carries the model files (``app_server/models/<name>.pt``); its workflow is
``hfl_components.flare.controllers.crosssite.CrossSiteEvalController``; every site runs the usual site script and
answers the ``cross_eval`` task (``hfl_components.flare.site_crosseval``). The server writes ``cross_site.json``,
``.csv`` and ``.png`` (sites x models) into its ``cxr_hfl_results``.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

CONTROLLER = "hfl_components.flare.controllers.crosssite.CrossSiteEvalController"
JOB_NAME = "cxr_hfl_cross_site"


def model_entries(files: list[str | Path]) -> list[dict]:
    """``[{"name", "file", "sha256", ...}]`` for model files (name: :func:`model_names`: an indexed run's file is
    named by its run folder and file stem, e.g. ``fedavg.site-1_deployed``).

    A file that a run's ``models.json`` lists (``RUN/models/<x>.pt``, ``RUN/global_model.pt``) is checked against
    its entry's SHA-256 and carries the entry's ``run``, ``kind``, ``site``, ``method`` and ``seed``
    (:func:`nvflare_jobs.models_index.find_entry`); any other model file is taken as it is, with its SHA-256.

    Raises:
        FileNotFoundError / ValueError: a file is missing, not a model file (``read_model_header``), or differs
            from its index entry (``ModelIndexError``), naming it.
    """
    from hfl_components.models.files import file_sha256, read_model_header
    from nvflare_jobs.models_index import find_entry

    out, paths = [], []
    for f in files:
        p = Path(f).resolve()
        if not p.exists():
            raise FileNotFoundError(f"--model {f}: no such file")
        if p.is_dir():
            raise ValueError(f"--model {f}: is a folder, not a model file (e.g. RUN/models/site-1_deployed.pt)")
        read_model_header(p)
        hit = find_entry(p)
        entry = {"file": str(p), "sha256": hit[1]["sha256"] if hit else file_sha256(p)}
        if hit:
            entry.update({"run": hit[0].name, **{k: hit[1].get(k) for k in ("kind", "site", "method", "seed")}})
        out.append(entry)
        paths.append((hit[0] if hit else None, p))
    for entry, name in zip(out, model_names(paths)):
        entry["name"] = name
    return [{"name": e.pop("name"), **e} for e in out]


def model_names(paths: list[tuple[Path | None, Path]]) -> list[str]:
    """Names that tell the models apart in the cross-site matrix: ``<run folder>.<file stem>`` for a file of an
    indexed run (e.g. ``ohfl.site-1_deployed``), the file stem for any other; more parent folders
    (``seed1.ohfl.site-1_deployed``) where two different files would still share a name, and ``-2``, ``-3`` only
    for the same file given twice. ``paths``: (run folder or None, file) pairs."""
    def label(run: Path | None, f: Path, depth: int) -> str:
        base = run if run is not None else f.parent
        parts = [q.name for q in [base, *base.parents][:depth] if q.name][::-1]
        return ".".join([*parts, f.stem])

    depth = [1 if run is not None else 0 for run, _ in paths]
    for _ in range(4):  # deepen every label that two different files share by one folder
        names = [label(r, f, d) for (r, f), d in zip(paths, depth)]
        clash = {n for n in names if len({f for (_, f), m in zip(paths, names) if m == n}) > 1}
        if not clash:
            break
        depth = [d + 1 if n in clash else d for n, d in zip(names, depth)]
    names, seen = [label(r, f, d) for (r, f), d in zip(paths, depth)], {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}-{seen[n]}")
    return out


def build_eval_job(profile: dict[str, dict], models: list[dict], min_sites: int | None = None):
    """A ``FedJob`` named ``cxr_hfl_cross_site``: the cross-site controller on the server (``models`` as
    :func:`model_entries` gives them; absolute files, as the simulator needs), the site script at every site."""
    from nvflare.apis.analytix import ANALYTIC_EVENT_TYPE
    from nvflare.app_common.widgets.convert_to_fed_event import ConvertToFedEvent
    from nvflare.job_config.api import FedJob
    from nvflare.job_config.script_runner import FrameworkType, ScriptRunner

    from hfl_components.flare.controllers.crosssite import CrossSiteEvalController
    from nvflare_jobs.jobs import SITE_SCRIPT, TASK_REQUEST_INTERVAL_S, ServerParams

    n = len(profile)
    ctl = CrossSiteEvalController(models=models, min_sites=int(min_sites or max(1, n - 1)))
    ctl.check_options()
    from hfl_components.flare.participation import EXPECTED_SITES_KEY

    job = FedJob(name=JOB_NAME, min_clients=ctl.min_sites,
                 meta_props={EXPECTED_SITES_KEY: sorted(profile)})  # "missing" is computable at the server
    job.to_server(ctl)
    job.to_server(ServerParams({"server": {"task_request_interval": TASK_REQUEST_INTERVAL_S}}))
    for site in profile:
        job.to(ScriptRunner(script=str(SITE_SCRIPT), framework=FrameworkType.RAW), site)
        job.to(ConvertToFedEvent(events_to_convert=[ANALYTIC_EVENT_TYPE]), site, id="progress_to_server")
    return job


def export_eval_job(profile: dict[str, dict], files: list[str | Path], out: str | Path,
                    min_sites: int | None = None) -> Path:
    """Export the cross-site job to ``out/cxr_hfl_cross_site`` with the model files inside its server app
    (``app_server/models/``) and the controller pointing at them relatively. Returns the job folder."""
    from nvflare_jobs.deploy import check_job_folder, export_portable

    models = model_entries(files)
    folder = export_portable(build_eval_job(profile, models, min_sites), out)
    dst = folder / "app_server" / "models"
    dst.mkdir(parents=True, exist_ok=True)
    for m in models:
        shutil.copy2(m["file"], dst / f"{m['name']}.pt")
        m["file"] = f"models/{m['name']}.pt"
    cfg = folder / "app_server" / "config" / "config_fed_server.json"
    doc = json.loads(cfg.read_text())
    for wf in doc.get("workflows", []):
        if wf.get("path") == CONTROLLER:
            wf["args"]["models"] = models
    cfg.write_text(json.dumps(doc, indent=4))
    check_job_folder(folder)
    return folder


def score_locally(site_config: str | Path, site: str, files: list[str | Path]) -> dict:
    """Score model files on one site's test split here, exactly as the site does in the job:
    ``{model name: test metrics | {"refused": reason}}``. Needs the site's data (its config's manifest)."""
    from hfl_components.flare.site_config import load_site_config
    from hfl_components.flare.site_crosseval import score_models
    from hfl_components.flare.site_tasks import SiteRuntime
    from hfl_components.models.files import load_model_file

    models, states = [], []
    for m in model_entries(files):
        model, header = load_model_file(m["file"])
        models.append({"name": m["name"], "spec": header["spec"], "labels": header.get("labels")})
        states.append(model.state_dict())
    with tempfile.TemporaryDirectory(prefix="cxr_hfl_eval_") as work:
        rt = SiteRuntime(load_site_config(site, site_config), work)
        return score_models(rt, models, states)
