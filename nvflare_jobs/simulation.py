"""One run API: :func:`simulate` runs a method on simulated hospital sites in the NVFlare simulator and returns a
:class:`Run`. ``cxr-hfl simulate``, ``cxr-hfl compare`` and the benchmarks call it; ``isolate=True`` runs it in a
fresh Python process (the simulator's ports, threads and logging stay out of the caller), with its console output in
a log file.

Options are the ``cxr-hfl simulate`` flags' destinations (:data:`DEFAULTS`: common settings; every method option of
the catalogue by its key, e.g. ``strategy``, ``lam``, ``ablate``), checked before anything is written
(:func:`check`); a bad option raises :class:`SimulateError` with one line naming it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hfl_components.flare import catalogue
from nvflare_jobs.method_options import (  # noqa: F401 - re-exported: callers and tests import them here
    OHFL_DEFAULTS,
    PAPER,
    _check_method_options,
    _defaults,
    _ohfl_defaults,
)
from nvflare_jobs.profiles import site_options_problem

# the common options (``cxr-hfl simulate`` flags and their defaults; the method options come from the catalogue)
DEFAULTS = {"data": None, "sites": 6, "scheme": "width", "alpha": 0.5, "labels": None, "rounds": None,
            "local_epochs": None, "finetune_epochs": None, "input_sizes": None, "batch_size": 16,
            "max_train_images": None, "seed": 0, "min_sites": None, "server_device": "auto", "late_wait": None,
            "feature_dim": 64, "aspect": None, "paper": False, "tracking": "tensorboard", "tracking_uri": None, "families": None}
_TYPES = {"sites": int, "alpha": float, "rounds": int, "local_epochs": int, "finetune_epochs": int, "batch_size": int,
          "max_train_images": int, "seed": int, "min_sites": int, "late_wait": int, "feature_dim": int}
# the least value of each bounded common option: the ``cxr-hfl simulate`` flags' own bounds (library callers too)
_AT_LEAST = {"rounds": 1, "local_epochs": 0, "finetune_epochs": 0, "batch_size": 1, "max_train_images": 1, "seed": 0,
             "min_sites": 1, "late_wait": 0, "feature_dim": 1}


class SimulateError(ValueError):
    """A simulation refused before it started (a bad option, no data); the message is one line naming the cause."""


@dataclass
class Run:
    """The outcome of :func:`simulate`.

    Attributes:
        out: the run folder (``metrics.json``, models, logs).
        method: the method run.
        rc: exit status (0 ok, 1 the simulation failed, 2 bad input, 3 the run failed after it started).
        metrics: the parsed ``metrics.json``, None when the run wrote none.
        log: the console log file (``isolate=True``), else None.
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


def method_option_defaults() -> dict:
    """``{key: command-line default}`` of every catalogue option (None where the method fills in its own)."""
    out = {}
    for key, users in catalogue.all_options().items():
        o = users[0][1]
        out[key] = [] if o.type is list else o.argparse_default
    return out


def namespace(method: str, profile: str | os.PathLike | None, options: dict | None,
              out: str | os.PathLike | None = None) -> argparse.Namespace:
    """The options of one run as ``cxr-hfl simulate`` would hold them: :data:`DEFAULTS` and the catalogue options'
    defaults, overridden by ``options`` (strings are typed for the common numeric options; method options are typed
    by the catalogue's checks).

    Raises:
        SimulateError: an unknown option key, a common option of the wrong type or below the command line's bound.
    """
    known = {**DEFAULTS, **method_option_defaults(), "probe": None}
    options = dict(options or {})
    bad = sorted(set(options) - set(known))
    if bad:
        raise SimulateError(f"unknown option(s) {bad} for {method}")
    for k, typ in _TYPES.items():
        v = options.get(k)
        if isinstance(v, str):
            try:
                options[k] = typ(v)
            except ValueError:
                raise SimulateError(f"option {k}: expected {typ.__name__}, got {v!r}") from None
    for k, least in _AT_LEAST.items():
        v = options.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v < least:
            raise SimulateError(f"option {k}: must be an integer >= {least}, got {v}")
    if isinstance(options.get("input_sizes"), str):
        options["input_sizes"] = [int(x) for x in options["input_sizes"].split(",") if x.strip()]
    return argparse.Namespace(**{**known, **options, "method": method,
                                 "profile": None if profile is None else str(profile),
                                 "out": None if out is None else str(out)})


def _one_line(e: SystemExit) -> SimulateError:
    return SimulateError(str(e.code).removeprefix("cxr-hfl: "))


def check(method: str, options: dict | None = None) -> dict:
    """Resolve and check the options of a run of ``method`` without running it (what :func:`simulate` does first):
    defaults filled, ``paper`` applied, the method's options checked by ``catalogue.validate_options``.

    Returns:
        the resolved options (``vars`` of the namespace).

    Raises:
        SimulateError: one line naming the method and the bad option.
    """
    if method not in catalogue.CATALOGUE:
        raise SimulateError(f"unknown method {method!r}; known: {', '.join(catalogue.methods())}")
    args = namespace(method, None, options)
    try:
        import contextlib
        import io

        with contextlib.redirect_stderr(io.StringIO()):  # warnings are printed again when the run starts
            _defaults(args)
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        raise _one_line(e) from None
    return vars(args)


def simulate(method: str, profile: str | os.PathLike | None, options: dict | None, out: str | os.PathLike, *,
             overwrite: bool = False, isolate: bool = False, log: str | os.PathLike | None = None,
             verbose: bool = False, log_config: str | None = None, gpu: str | None = None,
             command: str | None = None) -> Run:
    """Run ``method`` on simulated hospital sites in the NVFlare simulator.

    Args:
        method: a catalogue method.
        profile: a folder of ``<site>.yaml`` site configs, or None to partition ``options["data"]`` (default
            ``$CXR_DATA`` / ``../shared/data``) into ``options["sites"]`` simulated sites.
        options: see the module docstring (missing keys take :data:`DEFAULTS` / the catalogue defaults).
        out: the run folder.
        overwrite: replace an earlier run in ``out`` (otherwise such a folder is refused).
        isolate: run in a fresh Python process; its console output goes to ``log`` (default ``out/simulate.log``).
        verbose, log_config, gpu: NVFlare console logs, log mode/config file, simulator GPU ids.
        command: the command recorded in ``metrics.json`` (default: this process's argv).

    Returns:
        a :class:`Run`.

    Raises:
        SimulateError: bad options or no data (in process; isolated runs report them in the log and rc 2).
        FileExistsError: ``out`` holds an earlier run and ``overwrite`` is false (in process).
    """
    out = Path(out).resolve()
    if isolate:
        return _isolated(method, profile, options, out, overwrite=overwrite, log=log, verbose=verbose,
                         log_config=log_config, gpu=gpu, command=command)
    args = namespace(method, profile, options, out)
    args.overwrite = overwrite
    try:
        rc = _run_checked(args, verbose=verbose, log_config=log_config, gpu=gpu, command=command)
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        raise _one_line(e) from None
    return finished(method, out, rc)


def finished(method: str, out: str | os.PathLike, rc: int, log: Path | None = None) -> Run:
    """The :class:`Run` of a simulation that exited with ``rc`` (its ``metrics.json``, if written)."""
    out = Path(out)
    m = out / "metrics.json"
    return Run(out, method, int(rc), json.loads(m.read_text()) if m.is_file() else None, log)


def _isolated(method, profile, options, out: Path, *, overwrite, log, verbose, log_config, gpu, command) -> Run:
    """:func:`simulate` in a fresh interpreter, waited for."""
    proc, log = start(method, profile, options, out, overwrite=overwrite, log=log, verbose=verbose,
                      log_config=log_config, gpu=gpu, command=command)
    rc = proc.wait()
    return finished(method, out, rc, log)


def start(method: str, profile: str | os.PathLike | None, options: dict | None, out: str | os.PathLike, *,
          overwrite: bool = False, log: str | os.PathLike | None = None, verbose: bool = False,
          log_config: str | None = None, gpu: str | None = None,
          command: str | None = None) -> tuple[subprocess.Popen, Path]:
    """Start an isolated :func:`simulate` (``python -m nvflare_jobs.simulation SPEC``) and return at once:
    ``(process, log file)``; :func:`finished` reads the outcome once it has exited (a benchmark that kills a site
    while the run goes on uses this)."""
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = Path(log) if log else out / "simulate.log"
    spec = {"method": method, "profile": None if profile is None else str(profile), "options": dict(options or {}),
            "out": str(out), "overwrite": overwrite, "verbose": verbose, "log_config": log_config, "gpu": gpu,
            "command": command}
    spec_file = log.with_suffix(".spec.json")
    spec_file.write_text(json.dumps(spec, indent=1, default=str))
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "nvflare_jobs.simulation", str(spec_file)], stdout=fh,
                                stderr=subprocess.STDOUT)
    return proc, log


def main(argv: list[str] | None = None) -> int:
    """``python -m nvflare_jobs.simulation SPEC.json``: the child process of an isolated :func:`simulate`."""
    from nvflare_jobs.proctree import handle_interrupts

    spec_file = Path((argv or sys.argv[1:])[0])
    spec = json.loads(spec_file.read_text())
    spec_file.unlink(missing_ok=True)
    try:
        with handle_interrupts():
            return simulate(spec["method"], spec["profile"], spec["options"], spec["out"],
                            overwrite=spec["overwrite"], verbose=spec["verbose"], log_config=spec["log_config"],
                            gpu=spec["gpu"], command=spec["command"]).rc
    except (SimulateError, OSError) as e:
        print(f"cxr-hfl simulate: error: {e}", file=sys.stderr)
        return 2


def _run_checked(args, **kw) -> int:
    _defaults(args)
    if bad := site_options_problem(args):  # the simulated sites' options, before anything is scanned or written
        sys.exit(f"cxr-hfl: {bad}")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        sys.exit(f"cxr-hfl: --out {args.out} is a file, not a folder (the run folder)")
    if not args.profile and args.data and not Path(args.data).expanduser().exists():
        sys.exit(f"cxr-hfl: --data {args.data}: no such file or folder (give a folder in the Kaggle layout, class "
                 "folders, or a CSV with path,label columns)")
    return _run(args, **kw)


def prepare_profile(args, run_dir: Path) -> tuple[Path, dict, Path | None, Path | None]:
    """Partition (unless --profile) and write the site-config profile. Returns (profile_dir, profile, data_root,
    partition_dir)."""
    from chest_xray import CLASS_NAMES, partition_records, scan_dataset, write_partition
    from nvflare_jobs.profiles import PROTO_MIN_EVAL_PER_CLASS, proto_training_data, resolve_data, write_profile
    from hfl_components.flare.site_config import load_profile

    if args.profile:
        from hfl_components.flare.site_config import SiteConfigError, load_site_config

        profile_dir = Path(args.profile).resolve()
        profile = load_profile(profile_dir, check_files=False)
        for site, cfg in profile.items():  # the sites check their own files; warn here, but let the run go on
            try:
                load_site_config(site, cfg["config_path"])
            except SiteConfigError as e:
                print(f"WARNING: {e} -- this site will fail its tasks and be left out", file=sys.stderr)
        data = Path(args.data).resolve() if args.data else None
        return profile_dir, profile, data, None
    data = None
    if catalogue.is_prototype(args.method) and not args.data:
        data = proto_training_data(run_dir / "data_pool.csv")
    data = data or resolve_data(args.data)
    print(f"[cxr-hfl] data: {data}")
    records, report = scan_dataset(data, labels=args.labels)
    skipped = report.get("skipped", []) if isinstance(report, dict) else []
    print(f"[cxr-hfl] scanned {len(records)} usable images ({len(skipped)} skipped, see partition/scan_report.json)")
    if not records:
        raise SystemExit(f"cxr-hfl: no usable images under {data}")
    part_dir = run_dir / "partition"
    res = partition_records(records, args.sites, args.scheme, alpha=args.alpha, seed=args.seed,
                            class_names=CLASS_NAMES[args.labels],
                            min_eval_per_class=PROTO_MIN_EVAL_PER_CLASS if catalogue.is_prototype(args.method) else 0)
    write_partition(res, part_dir, extra={"labels": args.labels, "data_root": str(data)})
    (part_dir / "scan_report.json").write_text(json.dumps(report, indent=1, default=str))
    settings = {"batch_size": args.batch_size, "aspect": getattr(args, "aspect", None),
                "local_epochs": args.local_epochs if args.local_epochs is not None else args.default_local_epochs,
                "finetune_epochs": (args.finetune_epochs if args.finetune_epochs is not None
                                    else args.default_finetune_epochs), "seed": args.seed, "threads": 1,
                "max_train_images": args.max_train_images, "feature_dim": args.feature_dim}
    profile_dir = write_profile(part_dir, run_dir / "site_configs", args.method, args.labels, args.input_sizes, settings,
                                families=getattr(args, "families", None))
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


def _options(args, data_root, part_dir, on_server: bool = False) -> dict:
    """The job options. ``on_server`` (export-job): the probe is a path on the server machine, checked there at
    job start (before any site trains), so it must be absolute and is not looked up here."""
    from nvflare_jobs.profiles import default_probe

    probe = args.probe
    if catalogue.entry(args.method).option("probe") is not None and not probe:
        probe = default_probe(data_root, part_dir) if data_root else None
        if not probe:
            raise SystemExit("cxr-hfl: OHFL needs a public probe set for CKA: pass --probe DIR (public images, no "
                             "site's patients), a probe.csv from `cxr-hfl partition --probe-fraction`, or "
                             "--probe generated")
    if on_server and probe and probe not in ("generated", "none"):
        if not os.path.isabs(probe):
            raise SystemExit(f"cxr-hfl: --probe {probe}: give the probe's absolute path on the server machine "
                             "(the server checks it when the job starts, before any site trains)")
        probe = os.path.normpath(probe)
    elif probe and probe not in ("generated", "none"):
        probe = str(Path(probe).resolve())
        if not Path(probe).exists():
            raise SystemExit(f"cxr-hfl: --probe {probe} does not exist")
    opts = {"rounds": args.rounds, "local_epochs": args.local_epochs, "finetune_epochs": args.finetune_epochs,
            "seed": args.seed, "min_sites": args.min_sites, "late_wait_s": args.late_wait,
            "paper": bool(getattr(args, "paper", False))}
    opts.update({k: getattr(args, k, None) for k in catalogue.all_options()})  # every method's options
    opts.update({"probe": probe, "server_device": args.server_device})
    return opts


def _run(args, verbose: bool = False, log_config: str | None = None, gpu: str | None = None,
         command: str | None = None) -> int:
    """One simulation in this process (``args``: the resolved options namespace); returns the exit status."""
    from chest_xray import CLASS_NAMES
    from nvflare_jobs.jobs import build_job
    from nvflare_jobs.profiles import DataNotFoundError
    from nvflare_jobs.results import assemble_run, find_server_results, print_summary
    from hfl_components.flare.site_config import ENV_DIR, SiteConfigError

    t0 = time.perf_counter()
    _check_probe(args)
    run_dir = Path(args.out).resolve()
    keep = Path(args.profile).resolve() if args.profile else None
    made = not run_dir.exists()
    aside = run_dir / ".replaced_run"  # --overwrite: the earlier run waits here until this one starts
    _prepare_run_dir(run_dir, args.overwrite, keep, aside)
    built = False
    try:  # until the simulator starts, a refusal leaves nothing behind that a corrected rerun would trip over,
        # and an earlier run that --overwrite was to replace is put back
        try:
            profile_dir, profile, data_root, part_dir = prepare_profile(args, run_dir)
        except (DataNotFoundError, SiteConfigError) as e:
            print(f"cxr-hfl: {e}", file=sys.stderr)
            return 2
        if args.min_sites is not None and args.min_sites > len(profile):
            raise SystemExit(f"cxr-hfl: --min-sites {args.min_sites}: more than the profile's {len(profile)} "
                             "sites; no round could proceed")
        labels = next(iter(profile.values()))["data"]["labels"]
        if args.profile and labels != args.labels:
            print(f"[cxr-hfl] labels {labels} taken from the profile")
        opts = _options(args, data_root, part_dir)
        (run_dir / "resolved_configs").mkdir(exist_ok=True)
        for site, cfg in profile.items():
            (run_dir / "resolved_configs" / f"{site}.json").write_text(json.dumps(cfg, indent=1))
        (run_dir / "job_options.json").write_text(json.dumps(opts, indent=1))
        _announce(args.method, profile)
        job = build_job(args.method, profile, opts, tracking=args.tracking, tracking_uri=args.tracking_uri)
        built = True
    finally:
        if not built:
            _discard_unstarted(run_dir, made, keep)
            _restore_aside(run_dir, aside)
    if aside.exists():
        shutil.rmtree(aside)
    ws = run_dir / "workspace"
    if ws.exists():
        shutil.rmtree(ws)
    os.environ[ENV_DIR] = str(profile_dir)  # each simulated site finds <its name>.yaml here
    from nvflare_jobs.progress import LiveProgress, quiet_log_config
    from nvflare_jobs.proctree import INTERRUPTED, unique_simulator_ports

    unique_simulator_ports()  # see its docstring: the port race behind "Connection reset by peer" at start

    shown = log_config or ("concise" if verbose else str(quiet_log_config(run_dir)))
    print(f"[cxr-hfl] NVFlare logs: {ws}/<server|site>/log.txt" + ("" if verbose or log_config else
                                                                     " (--verbose shows them here)"))
    with LiveProgress(ws, list(profile), stream=sys.stdout if verbose else sys.stderr) as live:
        rc = job.simulator_run(str(ws), threads=len(profile), log_config=shown, gpu=gpu)
    if INTERRUPTED.is_set():  # NVFlare's runner swallows the KeyboardInterrupt and returns -9
        raise KeyboardInterrupt
    try:
        server_results = find_server_results(ws)
    except FileNotFoundError as e:
        print(f"cxr-hfl: the simulation failed (rc={rc}): {e}; see {ws}/*/log.txt", file=sys.stderr)
        return 1
    record = json.loads(Path(server_results).read_text())
    _copy_models(ws, run_dir / "models", profile, server_results)
    metrics = assemble_run(server_results, run_dir, labels=labels, seed=args.seed,
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


def _check_probe(args) -> None:
    """Refuse a ``--probe`` that does not exist, or (for a method that uses one) lists no images, before anything
    is written. Raises FileNotFoundError / ValueError naming the option."""
    if args.probe and args.probe not in ("generated", "none") and not Path(args.probe).exists():
        raise FileNotFoundError(f"--probe {args.probe} does not exist (a folder or probe.csv of public images, "
                                "or 'generated')")
    if args.probe and args.probe not in ("generated", "none") and catalogue.entry(args.method).option("probe"):
        from hfl_components.flare.probe import list_probe_files  # the server's own check, before anything runs

        if not list_probe_files(args.probe):
            raise ValueError(f"--probe {args.probe}: lists no images (a folder of public JPEG/PNG/DICOM images, "
                             "a probe.csv with a path column, or 'generated')")


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


if __name__ == "__main__":  # run the package's module (not this __main__ copy), so its names are the ones imported
    from nvflare_jobs.simulation import main as _main

    sys.exit(_main())
