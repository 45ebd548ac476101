"""Running a resolved :class:`~nvflare_jobs.spec.RunSpec` in this process: partition (unless the spec names a
profile) and write the site configs, build the NVFlare job, run the simulator into the run folder and assemble
``metrics.json``; or export the job folder. :meth:`RunSpec.simulate` and :meth:`RunSpec.export` call it. A
problem found before the simulator starts raises :class:`SimulateError` naming the option (``.key``); nothing here
exits the process.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hfl_components.flare import catalogue
from nvflare_jobs.profiles import site_options_problem


class SimulateError(ValueError):
    """A run refused before it started (a bad option, no data); the message is one line naming the cause, with
    the option as ``option 'key'``.

    Attributes:
        key: the option at fault (None when no one option is).
    """

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


@dataclass
class Run:
    """The outcome of :meth:`RunSpec.simulate <nvflare_jobs.spec.RunSpec.simulate>`.

    Attributes:
        out: the run folder (``metrics.json``, models, logs).
        method: the method run.
        rc: exit status (0 ok, 1 the simulation failed, 2 bad input, 3 the run failed after it started).
        metrics: the parsed ``metrics.json``, None when the run wrote none.
        log: the console log file (isolated runs), else None.
    """

    out: Path
    method: str
    rc: int
    metrics: dict | None = None
    log: Path | None = None

    @property
    def ok(self) -> bool:
        """True when the run finished and wrote its metrics."""
        return self.rc == 0 and self.metrics is not None


def finished(method: str, out: str | os.PathLike, rc: int, log: Path | None = None) -> Run:
    """The :class:`Run` of a simulation that exited with ``rc`` (its ``metrics.json``, if written)."""
    out = Path(out)
    m = out / "metrics.json"
    return Run(out, method, int(rc), json.loads(m.read_text()) if m.is_file() else None, log)


def run_in_process(spec, out: str | os.PathLike, *, overwrite: bool = False, verbose: bool = False,
                   log_config: str | None = None, gpu: str | None = None, command: str | None = None,
                   warn=None) -> Run:
    """Run ``spec`` (a resolved ``RunSpec``) in the NVFlare simulator in this process, into the run folder ``out``;
    ``warn(line)`` shows each of the spec's warnings (default: printed to stderr as ``WARNING: ...``).

    Raises:
        SimulateError: a problem found before the simulator starts (site options, data, probe, min sites).
        FileExistsError: ``out`` holds an earlier run and ``overwrite`` is false.
    """
    out = Path(out).resolve()
    for w in spec.warnings:
        (warn or _print_warning)(w)
    if bad := site_options_problem(spec):  # the simulated sites' options, before anything is scanned or written
        raise SimulateError(bad)
    if out.exists() and not out.is_dir():
        raise SimulateError(f"option 'out' {out} is a file, not a folder (the run folder)", "out")
    if not spec.profile and spec.data and not Path(spec.data).expanduser().exists():
        raise SimulateError(f"option 'data' {spec.data}: no such file or folder (give a folder in the Kaggle layout, "
                            "class folders, or a CSV with path,label columns)", "data")
    rc = _run(spec, out, overwrite, verbose=verbose, log_config=log_config, gpu=gpu, command=command)
    return finished(spec.method, out, rc)


def _print_warning(line: str) -> None:
    print(line if line.startswith("WARNING") else f"WARNING: {line}", file=sys.stderr)


def prepare_profile(spec, run_dir: Path) -> tuple[Path, dict, Path | None, Path | None]:
    """Partition ``spec.data`` (unless the spec names a profile) and write the site-config profile.

    Returns:
        ``(profile_dir, profile, data_root, partition_dir)``.

    Raises:
        SimulateError: no usable images. DataNotFoundError / SiteConfigError: no data, a bad site config.
    """
    from chest_xray import CLASS_NAMES, partition_records, scan_dataset, write_partition
    from nvflare_jobs.profiles import PROTO_MIN_EVAL_PER_CLASS, proto_training_data, resolve_data, write_profile
    from hfl_components.flare.site_config import load_profile

    if spec.profile:
        from hfl_components.flare.site_config import SiteConfigError, load_site_config

        profile_dir = Path(spec.profile).resolve()
        profile = load_profile(profile_dir, check_files=False)
        for site, cfg in profile.items():  # the sites check their own files; warn here, but let the run go on
            try:
                load_site_config(site, cfg["config_path"])
            except SiteConfigError as e:
                print(f"WARNING: {e} -- this site will fail its tasks and be left out", file=sys.stderr)
        data = Path(spec.data).resolve() if spec.data else None
        return profile_dir, profile, data, None
    data = None
    if catalogue.is_prototype(spec.method) and not spec.data:
        data = proto_training_data(run_dir / "data_pool.csv")
    data = data or resolve_data(spec.data)
    print(f"[cxr-hfl] data: {data}")
    records, report = scan_dataset(data, labels=spec.labels)
    skipped = report.get("skipped", []) if isinstance(report, dict) else []
    print(f"[cxr-hfl] scanned {len(records)} usable images ({len(skipped)} skipped, see partition/scan_report.json)")
    if not records:
        raise SimulateError(f"no usable images under {data}", "data")
    part_dir = run_dir / "partition"
    res = partition_records(records, spec.sites, spec.scheme, alpha=spec.alpha, seed=spec.seed,
                            class_names=CLASS_NAMES[spec.labels],
                            min_eval_per_class=PROTO_MIN_EVAL_PER_CLASS if catalogue.is_prototype(spec.method) else 0)
    write_partition(res, part_dir, extra={"labels": spec.labels, "data_root": str(data)})
    (part_dir / "scan_report.json").write_text(json.dumps(report, indent=1, default=str))
    local_epochs, finetune_epochs = spec.site_epochs
    settings = {"batch_size": spec.batch_size, "aspect": spec.aspect, "augment": spec.augment, "local_epochs": local_epochs,
                "finetune_epochs": finetune_epochs, "seed": spec.seed, "threads": 1,
                "max_train_images": spec.max_train_images, "feature_dim": spec.feature_dim}
    profile_dir = write_profile(part_dir, run_dir / "site_configs", spec.method, spec.labels, list(spec.input_sizes),
                                settings, families=spec.families)
    return profile_dir, load_profile(profile_dir), data, part_dir


RUN_OUTPUTS = ("metrics.json", "models.json", "sites.csv", "rounds.csv", "test_predictions.csv", "job_options.json",
               "global_model.pt", "global_fused.pt", "global_models",
               "nvflare_log_config.json", "alignment_record.json", "report.html", "models", "workspace",
               "resolved_configs", "site_configs", "partition", "external", "data_pool.csv")


def _prepare_run_dir(run_dir: Path, overwrite: bool, keep: Path | None = None, aside: Path | None = None) -> None:
    """Refuse to mix a new run with an earlier one in the same folder, unless --overwrite clears the old one.
    ``keep``: a path inside the folder that this run reads (a --profile kept there, as `cxr-hfl compare` does).
    ``aside``: a folder the old run's files are moved into instead of deleted (:func:`_restore_aside` puts them
    back when the new run is refused before it starts)."""
    old = [n for n in RUN_OUTPUTS if (run_dir / n).exists() and (run_dir / n).resolve() != keep]
    if old and not overwrite:
        what = "finished" if (run_dir / "metrics.json").exists() else "unfinished: interrupted or failed"
        raise FileExistsError(f"run folder {run_dir} already holds a run ({what}; {', '.join(old[:4])}...). "
                              "A simulate run cannot be resumed: rerun with --overwrite to replace it, or choose "
                              "another --out "
                              "(`cxr-hfl compare` resumes its unfinished runs when rerun with the same --out)")
    if aside is not None and old:
        if aside.exists():  # left by a process killed before it could restore or drop it
            shutil.rmtree(aside)
        aside.mkdir(parents=True)
    for p in [run_dir / n for n in old] + (sorted(run_dir.glob("*.png")) if old else []):
        if aside is not None:
            p.rename(aside / p.name)
        else:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)


def _restore_aside(run_dir: Path, aside: Path) -> None:
    """Move the earlier run's files that :func:`_prepare_run_dir` set ``aside`` back into ``run_dir``."""
    if aside.is_dir():
        for p in aside.iterdir():
            if not (run_dir / p.name).exists():
                p.rename(run_dir / p.name)
        shutil.rmtree(aside)


def _discard_unstarted(run_dir: Path, made: bool, keep: Path | None = None) -> None:
    """Remove what a run refused before its simulator started wrote into ``run_dir`` (partition, site configs,
    resolved configs, job options: :data:`RUN_OUTPUTS`; :func:`_prepare_run_dir` has already cleared or refused
    an earlier run's), and ``run_dir`` itself when this run ``made`` it and it is left empty. ``keep``: a profile
    inside the folder that the run reads (kept)."""
    for n in RUN_OUTPUTS:
        p = run_dir / n
        if p.exists() and p.resolve() != keep:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    if made and run_dir.is_dir() and not any(run_dir.iterdir()):
        run_dir.rmdir()


def job_options(spec, data_root, part_dir, on_server: bool = False) -> dict:
    """The job options of ``spec`` (:meth:`RunSpec.job_options`) with its probe resolved: given, else the
    partition's or the data's default probe. ``on_server`` (export): the probe is a path on the server machine,
    checked there at job start (before any site trains), so it must be absolute and is not looked up here.

    Raises:
        SimulateError: a method that needs a probe has none, or the probe does not exist / is not absolute.
    """
    from nvflare_jobs.profiles import default_probe

    probe = spec.options.get("probe")
    if "probe" in spec.options and not probe:
        probe = default_probe(data_root, part_dir) if data_root else None
        if not probe:
            raise SimulateError("OHFL needs a public probe set for CKA: give option 'probe' DIR (public images, no "
                                "site's patients), a probe.csv from `cxr-hfl partition --probe-fraction`, or "
                                "option 'probe' generated", "probe")
    if on_server and probe and probe not in ("generated", "none"):
        if not os.path.isabs(probe):
            raise SimulateError(f"option 'probe' {probe}: give the probe's absolute path on the server machine "
                                "(the server checks it when the job starts, before any site trains)", "probe")
        probe = os.path.normpath(probe)
    elif probe and probe not in ("generated", "none"):
        probe = str(Path(probe).resolve())
        if not Path(probe).exists():
            raise SimulateError(f"option 'probe' {probe} does not exist", "probe")
    return spec.job_options(probe)


def _run(spec, run_dir: Path, overwrite: bool, verbose: bool = False, log_config: str | None = None,
         gpu: str | None = None, command: str | None = None) -> int:
    """One simulation of ``spec`` in this process into ``run_dir``; returns the exit status."""
    t0 = time.perf_counter()
    ready = _prepare_job(spec, run_dir, overwrite)
    if isinstance(ready, int):
        return ready
    job, profile_dir, profile, labels = ready
    from hfl_components.flare.site_config import ENV_DIR

    os.environ[ENV_DIR] = str(profile_dir)  # each simulated site finds <its name>.yaml here
    ws = run_dir / "workspace"
    rc, live = _simulate(job, ws, run_dir, list(profile), verbose, log_config, gpu)
    return _collect(spec, run_dir, ws, rc, live, profile, profile_dir, labels, t0, command)


def _prepare_job(spec, run_dir: Path, overwrite: bool):
    """Everything before the simulator starts: the run folder, the partition and site configs, the job options and
    the NVFlare job. Returns ``(job, profile_dir, profile, labels)``, or the exit status 2 of a refused data folder
    or site config (one line on stderr). Until the job is built a refusal leaves nothing behind that a corrected
    rerun would trip over, and an earlier run that ``overwrite`` was to replace is put back.

    Raises:
        SimulateError: an option that cannot work with the profile (named by its key).
    """
    from nvflare_jobs.jobs import build_job
    from nvflare_jobs.profiles import DataNotFoundError
    from hfl_components.flare.site_config import SiteConfigError

    _check_probe(spec)
    keep = Path(spec.profile).resolve() if spec.profile else None
    made = not run_dir.exists()
    aside = run_dir / ".replaced_run"  # --overwrite: the earlier run waits here until this one starts
    _prepare_run_dir(run_dir, overwrite, keep, aside)
    built = False
    try:
        try:
            profile_dir, profile, data_root, part_dir = prepare_profile(spec, run_dir)
        except (DataNotFoundError, SiteConfigError) as e:
            print(f"cxr-hfl: {e}", file=sys.stderr)
            return 2
        if spec.min_sites is not None and spec.min_sites > len(profile):
            raise SimulateError(f"option 'min_sites' {spec.min_sites}: more than the profile's {len(profile)} "
                                "sites; no round could proceed", "min_sites")
        labels = next(iter(profile.values()))["data"]["labels"]
        if spec.profile and labels != spec.labels:
            print(f"[cxr-hfl] labels {labels} taken from the profile")
        opts = job_options(spec, data_root, part_dir)
        (run_dir / "resolved_configs").mkdir(exist_ok=True)
        for site, cfg in profile.items():
            (run_dir / "resolved_configs" / f"{site}.json").write_text(json.dumps(cfg, indent=1))
        (run_dir / "job_options.json").write_text(json.dumps(opts, indent=1))
        _announce(spec.method, profile)
        job = build_job(spec.method, profile, opts, tracking=spec.tracking, tracking_uri=spec.tracking_uri)
        built = True
    finally:
        if not built:
            _discard_unstarted(run_dir, made, keep)
            _restore_aside(run_dir, aside)
    if aside.exists():
        shutil.rmtree(aside)
    return job, profile_dir, profile, labels


def _simulate(job, ws: Path, run_dir: Path, sites: list[str], verbose: bool, log_config: str | None,
              gpu: str | None):
    """Run the NVFlare simulator on ``job`` in a fresh workspace ``ws`` with live progress; returns ``(rc, live)``.

    Raises:
        KeyboardInterrupt: the run was interrupted (NVFlare's runner swallows it and returns -9).
    """
    from nvflare_jobs.progress import LiveProgress, quiet_log_config
    from nvflare_jobs.proctree import INTERRUPTED, unique_simulator_ports

    if ws.exists():
        shutil.rmtree(ws)
    unique_simulator_ports()  # see its docstring: the port race behind "Connection reset by peer" at start
    shown = log_config or ("concise" if verbose else str(quiet_log_config(run_dir)))
    print(f"[cxr-hfl] NVFlare logs: {ws}/<server|site>/log.txt" + ("" if verbose or log_config else
                                                                     " (--verbose shows them here)"))
    with LiveProgress(ws, sites, stream=sys.stdout if verbose else sys.stderr) as live:
        rc = job.simulator_run(str(ws), threads=len(sites), log_config=shown, gpu=gpu)
    if INTERRUPTED.is_set():
        raise KeyboardInterrupt
    return rc, live


def _collect(spec, run_dir: Path, ws: Path, rc, live, profile: dict, profile_dir: Path, labels: str, t0: float,
             command: str | None) -> int:
    """The finished simulation's results into ``run_dir`` (models, metrics.json, the summary); returns the exit
    status: 1 when the server wrote no results, 3 when the run failed, else the simulator's."""
    from chest_xray import CLASS_NAMES
    from nvflare_jobs.results import assemble_run, find_server_results, print_summary

    try:
        server_results = find_server_results(ws)
    except FileNotFoundError as e:
        print(f"cxr-hfl: the simulation failed (rc={rc}): {e}; see {ws}/*/log.txt", file=sys.stderr)
        return 1
    record = json.loads(Path(server_results).read_text())
    _copy_models(ws, run_dir / "models", profile, server_results)
    metrics = assemble_run(server_results, run_dir, labels=labels, seed=spec.seed,
                           wall_time_s=time.perf_counter() - t0, class_names=CLASS_NAMES[labels],
                           extra={"command": command or " ".join(sys.argv), "profile": str(profile_dir)})
    print_summary(metrics, run_dir)
    if record.get("failed"):
        print(f"cxr-hfl: the run failed: {record['failed']}; partial results "
              f"in {run_dir}, logs in {ws}/*/log.txt", file=sys.stderr)
        return 3
    if live.last_status and live.last_status.get("phase") not in ("done", None):
        print(f"cxr-hfl: the server stopped in phase {live.last_status.get('phase')!r}; see {ws}/server/log.txt",
              file=sys.stderr)
    return 0 if rc in (0, None) else int(rc)


def _announce(method: str, profile: dict) -> None:
    """Print the run's sites (family, depth, input size) and, when any shares per-image test probabilities, a note."""
    print(f"[cxr-hfl] {method}: {len(profile)} sites: " + ", ".join(
        f"{s}={c['model']['family']}/{c['model'].get('depth', '')}@{c['input_size']}px" for s, c in profile.items()))
    sharing = [s for s, c in profile.items() if c.get("share_predictions")]
    if sharing:
        print(f"[cxr-hfl] note: {len(sharing)} of {len(profile)} simulated sites send per-image test probabilities "
              "to the server for pooled metrics (share_predictions: true); a real site's default is false")


def _check_probe(spec) -> None:
    """Refuse a probe that does not exist, or lists no images, before anything is written. Raises SimulateError
    naming the option."""
    probe = spec.options.get("probe")
    if probe and probe not in ("generated", "none") and not Path(probe).exists():
        raise SimulateError(f"option 'probe' {probe} does not exist (a folder or probe.csv of public images, "
                            "or 'generated')", "probe")
    if probe and probe not in ("generated", "none"):
        from hfl_components.flare.probe import list_probe_files  # the server's own check, before anything runs

        if not list_probe_files(probe):
            raise SimulateError(f"option 'probe' {probe}: lists no images (a folder of public JPEG/PNG/DICOM "
                                "images, a probe.csv with a path column, or 'generated')", "probe")


def _copy_models(ws: Path, models_dir: Path, profile: dict, server_results: Path) -> None:
    """Copy each site's deployed / local / federated model from the simulator workspace into ``models_dir`` as
    ``<site>_<kind>.pt``; a site that failed the final evaluation keeps no model file of this run."""
    models_dir.mkdir(exist_ok=True)
    for site in profile:
        for name in ("deployed_model.pt", "local_model.pt", "federated_model.pt"):
            src = ws / site / "cxr_hfl_state" / name
            if src.is_file():
                shutil.copy2(src, models_dir / f"{site}_{name.replace('_model.pt', '')}.pt")
    for stale in [p for p in models_dir.glob("*.pt") if p.name.split("_")[0] not in _final_sites(server_results)]:
        stale.unlink()


def _final_sites(server_results: Path) -> set[str]:
    return set(json.loads(Path(server_results).read_text()).get("sites", {}))


# options that describe the simulated sites (partition and per-site configs); with a profile the site configs
# decide them, so an export refuses them instead of silently dropping them (value: the site config's key)
SITE_OPTIONS = {"data": None, "sites": None, "scheme": None, "alpha": None, "input_sizes": "input_size",
                "batch_size": "batch_size", "max_train_images": "max_train_images", "feature_dim": "model.feature_dim",
                "families": "model.family", "aspect": "aspect", "augment": "augment"}


def export_job(spec, job_dir: Path, given: set | None = None) -> Path:
    """Write the NVFlare job folder of ``spec`` into ``job_dir`` (:meth:`RunSpec.export`); ``given``: the option
    keys the caller gave (site options among them are refused: each hospital's config decides them).

    Returns:
        the job folder.

    Raises:
        SimulateError: a method that is no federated job (the pooled-data reference ``central``), no profile, a
            site option given, a probe that is not an absolute server path.
    """
    from hfl_components.flare.site_config import load_profile
    from nvflare_jobs.deploy import export_portable, not_a_job
    from nvflare_jobs.jobs import build_job

    if not catalogue.deployable(spec.method):
        raise SimulateError(not_a_job(spec.method), "method")
    if not spec.profile:
        raise SimulateError("option 'profile' DIR (the consortium's site names and model specs) is required to "
                            "export a job", "profile")
    bad = [k for k in SITE_OPTIONS if k in (given or ())]
    if bad:
        keys = ", ".join(f"option {k!r} (site key {SITE_OPTIONS[k]})" if SITE_OPTIONS[k] else f"option {k!r}"
                         for k in bad)
        raise SimulateError(f"{keys}: with a profile each hospital's <site>.yaml decides this; a job does not carry "
                            "it. Set it in the profile's site configs (and in each hospital's own config), or drop "
                            "the option.", bad[0])
    profile = load_profile(spec.profile, check_files=False, require_data=False)
    opts = job_options(spec, None, None, on_server=True)
    job = build_job(spec.method, profile, opts, tracking=spec.tracking, tracking_uri=spec.tracking_uri)
    job_dir = Path(job_dir).resolve()
    export_portable(job, job_dir)  # site script path made relative to the app's custom/ folder (portable to sites)
    return job_dir / job.name
