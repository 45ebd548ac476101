"""A run of one method, resolved once: :func:`resolve` turns what a caller gives (``cxr-hfl simulate`` flags, a
``compare`` variant, a benchmark's dict) into a frozen :class:`RunSpec`, and the spec either runs in the NVFlare
simulator (:meth:`RunSpec.simulate`) or writes an NVFlare job folder (:meth:`RunSpec.export`), as NVFlare's
``Recipe.execute(env)`` / ``Recipe.export(job_dir)`` do.

Every default has one owner. The run's own options (data, sites, partition scheme, sizes, seed, tracking...) are
declared once in :data:`RUN_OPTIONS`; a method's options, its labels, rounds, epochs and input sizes, its presets
(OHFL's ``paper``) and its cross-option checks are the method's catalogue entry
(:mod:`hfl_components.flare.catalogue`). The command line builds its flags from these declarations and restates no
default; downstream code (controllers, compare, benchmarks) reads the spec.

A bad option raises :class:`SimulateError` (a ValueError) whose ``key`` names the option and whose message names it
as ``option 'key'``; only the command line turns that into its flag (:func:`flag_of`) and an exit code.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from chest_xray import ASPECTS
from hfl_components.flare import catalogue
from hfl_components.flare.site_config import AUGMENTS, PER_IMAGE_AUGMENTS
from hfl_components.flare.options import Option, OptionError, check_option
from nvflare_jobs.runner import Run, SimulateError, export_job, finished, run_in_process


def _at_least(least: int):
    def check(v):
        return None if v >= least else f"must be an integer >= {least}, got {v}"
    return check


def _sizes_check(v) -> str | None:
    return None if v and all(16 <= x <= 1024 for x in v) else f"input sizes must be integers from 16 to 1024 px, got {v}"


def _int_list(v) -> tuple[int, ...]:
    """``"64,96"`` or ``[64, 96]`` as a tuple of ints (ValueError for anything else)."""
    items = [x for x in v.split(",") if x.strip()] if isinstance(v, str) else list(v)
    return tuple(int(x) for x in items)


TRACKING = ("tensorboard", "mlflow", "none")
# The run's own options: what describes the simulated sites and the run around the method. A method's options
# (OHFL's strategy, FedTopo's rho, ...) and its labels / rounds / epochs / input sizes are its catalogue entry's.
RUN_OPTIONS: tuple[Option, ...] = (
    Option("data", str, None, help="data root (Kaggle layout, class folders, or CSV); default $CXR_DATA, "
           "../shared/data"),
    Option("profile", str, None, help="folder of <site>.yaml site configs (skips partitioning; default: none, "
           "--data is partitioned into --sites simulated sites)"),
    Option("sites", int, 6, help="number of simulated hospital sites", check=_at_least(1)),
    Option("scheme", str, "width", ("width", "dirichlet", "pathological"),
           "how the simulated sites are partitioned: width (OHFL resolution split, site-1 narrowest), dirichlet "
           "(label skew, --alpha) or pathological (a fixed number of classes per site)"),
    Option("alpha", float, 0.5, help="Dirichlet alpha (dirichlet scheme)"),
    Option("labels", str, None, ("binary", "subtype"), "label scheme (default: the method's)"),
    Option("rounds", int, None, help="federated rounds (default: the method's; OHFL is one-shot; FENS: aggregator "
           "rounds after its one upload)", check=_at_least(1)),
    Option("local_epochs", int, None, help="local epochs per round, at least 1 (OHFL, FENS: before the upload; "
           "default: the method's)", check=_at_least(0)),
    Option("finetune_epochs", int, None, help="OHFL fine-tuning epochs at each site (default: the method's)",
           check=_at_least(0)),
    Option("input_sizes", _int_list, None, help="input sizes (16 to 1024 px), smallest to largest, assigned to "
           "sites by image width (default: the method's)", check=_sizes_check),
    Option("batch_size", int, 16, help="training batch size of every simulated site", check=_at_least(1)),
    Option("max_train_images", int, None, help="cap each site's training images (quick tests; default: no cap)",
           check=_at_least(1)),
    Option("seed", int, 0, help="seed of the run: partition, model initialisation and training",
           check=_at_least(0)),
    Option("min_sites", int, None, help="fewest usable sites for a round to proceed (default N-1)",
           check=_at_least(1)),
    Option("late_wait", int, None, help="fixed seconds to wait for the remaining sites once --min-sites have "
           "answered (0 = wait for every live site). Default: adaptive, max(60 s, 3 x the slowest answering site's "
           "compute time), keeping sites that still send heartbeats. Sites that are not running or have gone "
           "silent are dropped at once either way.", check=_at_least(0)),
    Option("feature_dim", int, 64, help="common feature dimension d of the prototype methods' site backbones",
           check=_at_least(1)),
    Option("aspect", str, None, ASPECTS, "how every site makes non-square images square: stretch (default), "
           "letterbox (zero padding) or crop (centred square); written into each generated site config "
           "(docs/decisions.md)"),
    Option("augment", str, None, AUGMENTS, "training augmentation of every site, written into each generated site "
           "config: monai (default: flip + affine per image), batch (per collated batch), border (monai + random "
           "black/grey/white bands framing every class), border_dense (bands on most images, wider, any grey), "
           "border_raw (border_dense's bands added to the decoded image before resizing and intensity scaling, as "
           "the border probe adds them), zoom_out (the border probe's frame at a random share of up to 0.06 of each "
           "side: a centred zoom-out of the film, aspect kept)"),
    Option("families", str, None, help="one model family per site, comma-separated in site order (cnn, vgg11, "
           "hetero_cnn, densenet, resnet, efficientnet), e.g. cnn,cnn,densenet,densenet,resnet,resnet (default: cnn "
           "at every site; not for prototype methods)"),
    Option("paper", bool, False, help="a method's paper preset (OHFL: the OHFL paper's pipeline exactly)"),
    Option("tracking", str, "tensorboard", TRACKING, "experiment tracking on the server (NVFlare's receivers of "
           "the sites' tracking scalars): tensorboard (event files in the server's run folder, tb_events/<site>/), "
           "mlflow (also TensorBoard; needs the cxr-hfl[mlflow] extra), none"),
    Option("tracking_uri", str, None, help="MLflow tracking URI (default: a local SQLite store mlflow.db in the "
           "server's job results)"),
)
_RUN = {o.key: o for o in RUN_OPTIONS}
# presets a method may declare (catalogue ``MethodEntry.presets``), switched on by a run option of the same name
PRESETS = ("paper",)


def option(key: str) -> Option | None:
    """The declaration of ``key``: a run option, else the first catalogue method's option of that name."""
    if key in _RUN:
        return _RUN[key]
    users = catalogue.all_options().get(key)
    return users[0][1] if users else None


def flag_of(key: str) -> str:
    """The command-line flag of an option key (``lam`` -> ``--lambda``, ``late_wait`` -> ``--late-wait``)."""
    o = option(key)
    return o.cli_flag if o is not None else "--" + key.replace("_", "-")


def cli_message(e: Exception) -> str:
    """A library error as the command line says it: each ``option 'key'`` written as its flag."""
    return re.sub(r"option '(\w+)'(?! \(--)", lambda m: flag_of(m.group(1)), str(e))


@dataclass(frozen=True)
class RunSpec:
    """One run of one method, every option resolved and checked (:func:`resolve`). Frozen: read it, never edit it.

    Attributes (run options, :data:`RUN_OPTIONS`): ``data``, ``profile``, ``sites``, ``scheme``, ``alpha``,
    ``labels``, ``rounds``, ``local_epochs`` / ``finetune_epochs`` (None: given nowhere; each site config, or the
    method's default for generated configs, decides: :attr:`site_epochs`), ``input_sizes`` (px), ``batch_size``,
    ``max_train_images``, ``seed``, ``min_sites``, ``late_wait`` (s), ``feature_dim``, ``aspect``, ``augment``, ``families``,
    ``paper``, ``tracking``, ``tracking_uri``; ``method``; ``options``: the method's own options, typed, with the
    catalogue's defaults and its presets applied; ``warnings``: one line each (an ignored option, a constant loss).
    """

    method: str
    data: str | None
    profile: str | None
    sites: int
    scheme: str
    alpha: float
    labels: str
    rounds: int
    local_epochs: int | None
    finetune_epochs: int | None
    input_sizes: tuple[int, ...]
    batch_size: int
    max_train_images: int | None
    seed: int
    min_sites: int | None
    late_wait: int | None
    feature_dim: int
    aspect: str | None
    augment: str | None
    families: str | None
    paper: bool
    tracking: str
    tracking_uri: str | None
    options: Mapping[str, Any] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    def __getattr__(self, key: str):
        """A method option by its key (``spec.distill_steps``); AttributeError for anything else."""
        opts = self.__dict__.get("options") or {}
        if key in opts:
            return opts[key]
        raise AttributeError(f"{type(self).__name__} of {self.__dict__.get('method')} has no option {key!r}")

    @property
    def entry(self) -> catalogue.MethodEntry:
        """The method's catalogue entry."""
        return catalogue.entry(self.method)

    @property
    def site_epochs(self) -> tuple[int, int]:
        """``(local, fine-tuning)`` epochs written into generated site configs: the given ones, else the method's."""
        e = self.entry
        return (e.local_epochs if self.local_epochs is None else self.local_epochs,
                e.finetune_epochs if self.finetune_epochs is None else self.finetune_epochs)

    def job_options(self, probe: str | None) -> dict:
        """The job's options (``nvflare_jobs.jobs.build_job``; ``job_options.json``): the common job settings and
        the method's own options, with ``probe`` resolved where the run is (:mod:`nvflare_jobs.runner`)."""
        opts = {"rounds": self.rounds, "local_epochs": self.local_epochs, "finetune_epochs": self.finetune_epochs,
                "seed": self.seed, "min_sites": self.min_sites, "late_wait_s": self.late_wait, "paper": self.paper}
        opts.update(self.options)
        if "probe" in self.options:
            opts["probe"] = probe
        return opts

    def to_dict(self) -> dict:
        """A JSON-able copy (lists for tuples); :func:`from_dict` reads it back."""
        d = {f.name: getattr(self, f.name) for f in fields(self)} | {"options": dict(self.options)}
        return json.loads(json.dumps(d, default=list))

    def replace(self, **given) -> "RunSpec":
        """A new spec with some options given again (resolved and checked anew from this spec's given values)."""
        return resolve(self.method, {**self.given(), **given})

    def given(self) -> dict:
        """The options as values a caller could give :func:`resolve` to get this spec back."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("method", "options", "warnings")}
        return {**{k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items() if v is not None},
                **self.options}

    def simulate(self, out: str | os.PathLike, *, overwrite: bool = False, isolate: bool = False,
                 log: str | os.PathLike | None = None, verbose: bool = False, log_config: str | None = None,
                 gpu: str | None = None, command: str | None = None, warn=None) -> Run:
        """Run the spec in the NVFlare simulator into the run folder ``out``.

        Args:
            overwrite: replace an earlier run in ``out`` (otherwise such a folder is refused).
            isolate: run in a fresh Python process (the simulator's ports, threads and logging stay out of the
                caller); its console output goes to ``log`` (default ``out/simulate.log``).
            verbose, log_config, gpu: NVFlare console logs, log mode or config file, simulator GPU ids.
            command: the command recorded in ``metrics.json`` (default: this process's argv).
            warn: ``warn(line)`` shows each of :attr:`warnings` (default: printed to stderr).

        Returns:
            a :class:`~nvflare_jobs.runner.Run` (rc 0 done, 1 the simulation failed, 2 bad input, 3 the run failed
            after it started).

        Raises:
            SimulateError: a problem found before the simulator starts (in process; isolated runs report it in the
                log and rc 2). FileExistsError: ``out`` holds an earlier run and ``overwrite`` is false.
        """
        if isolate:
            proc, log = self.start(out, overwrite=overwrite, log=log, verbose=verbose, log_config=log_config,
                                   gpu=gpu, command=command)
            return finished(self.method, Path(out).resolve(), proc.wait(), log)
        return run_in_process(self, out, overwrite=overwrite, verbose=verbose, log_config=log_config, gpu=gpu,
                              command=command, warn=warn)

    def start(self, out: str | os.PathLike, *, overwrite: bool = False, log: str | os.PathLike | None = None,
              verbose: bool = False, log_config: str | None = None, gpu: str | None = None,
              command: str | None = None) -> tuple[subprocess.Popen, Path]:
        """Start an isolated :meth:`simulate` (``python -m nvflare_jobs.spec RUN.json``) and return at once:
        ``(process, log file)``; ``nvflare_jobs.runner.finished`` reads the outcome once it has exited (a benchmark
        that kills a site while the run goes on uses this)."""
        out = Path(out).resolve()
        out.mkdir(parents=True, exist_ok=True)
        log = Path(log) if log else out / "simulate.log"
        job = {"spec": self.to_dict(), "out": str(out), "overwrite": overwrite, "verbose": verbose,
               "log_config": log_config, "gpu": gpu, "command": command}
        job_file = log.with_suffix(".spec.json")
        job_file.write_text(json.dumps(job, indent=1, default=str))
        with open(log, "w") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "nvflare_jobs.spec", str(job_file)], stdout=fh,
                                    stderr=subprocess.STDOUT)
        return proc, log

    def export(self, job_dir: str | os.PathLike, given: set | None = None) -> Path:
        """Write the NVFlare job folder of this spec into ``job_dir`` (for ``nvflare job submit -j``). Needs a
        ``profile`` (the consortium's site names and model specs); with it, the site options (``data``, ``sites``,
        sizes, ...) are each hospital's own config and must not be given.

        Returns:
            the job folder (``job_dir / <job name>``).

        Raises:
            SimulateError: a method that is no federated job (the pooled-data reference ``central``), no profile, a
                site option given (``given``: the keys the caller gave), or a probe that is not an absolute server
                path.
        """
        return export_job(self, Path(job_dir), given)


def _typed(key: str, o: Option, v, method: str):
    """The checked value of run option ``o`` (SimulateError naming ``option 'key'``)."""
    if o.type is _int_list:
        try:
            v = _int_list(v)
        except (TypeError, ValueError):
            raise SimulateError(f"option {key!r}: expected comma-separated integers, got {v!r}", key) from None
        msg = o.check(v)
        if msg:
            raise SimulateError(f"option {key!r}: {msg}", key)
        return v
    try:
        return check_option(method, o, v)
    except OptionError as e:
        msg = str(e).split(f"({o.cli_flag}): ", 1)[-1].split(f"({o.cli_flag}) ", 1)[-1]
        raise SimulateError(f"option {key!r}: {msg}", key) from None


def resolve(method: str, given: Mapping[str, Any] | None = None) -> RunSpec:
    """Resolve and check the options of one run of ``method`` before anything is scanned or written.

    Args:
        method: a catalogue method.
        given: option key -> value (run options, :data:`RUN_OPTIONS`, and the method's catalogue options);
            missing or None keys take their defaults. Strings are typed (``"4"`` -> 4) as on the command line.

    Returns:
        the :class:`RunSpec`. Defaults come from :data:`RUN_OPTIONS` and the method's catalogue entry; a preset
        (``paper=True``) is applied first and refuses a given option that contradicts it.

    Raises:
        SimulateError: one line naming the method and the option (``.key``): an unknown method or option, a value
            of the wrong type or out of range, a preset the method lacks or contradicted, a strict option of
            another method, a failed entry check (e.g. OHFL with no probe pool and no data-free distillation).
    """
    if method not in catalogue.CATALOGUE:
        raise SimulateError(f"unknown method {method!r}; known: {', '.join(catalogue.methods())}", "method")
    e = catalogue.entry(method)
    given = {k: v for k, v in dict(given or {}).items() if v is not None}
    foreign = catalogue.all_options()
    bad = sorted(set(given) - set(_RUN) - set(foreign))
    if bad:
        raise SimulateError(f"unknown option(s) {bad} for {method}", bad[0])
    run = {k: (_typed(k, _RUN[k], given[k], method) if k in given else _RUN[k].default) for k in _RUN}
    check_augment(method, run["augment"])
    own = {o.key for o in e.options}
    warnings = _drop_foreign(method, given, own, foreign)
    method_given = {k: v for k, v in given.items() if k in own}
    for name in PRESETS:
        if not run[name]:
            continue
        preset = e.presets.get(name)
        if preset is None:
            raise SimulateError(f"option {name!r} is a preset of "
                                f"{', '.join(m for m, x in catalogue.CATALOGUE.items() if name in x.presets)} "
                                f"(not of {method})", name)
        for k, v in preset.items():
            cur = run.get(k) if k in _RUN else method_given.get(k)
            if cur is not None and _typed_like(k, cur, method) != v:
                raise SimulateError(f"option {name!r} runs the paper's pipeline ({_shown(k, v)}); drop "
                                    f"{_shown(k, cur)}", k)
            if k in _RUN:
                run[k] = v
            else:
                method_given[k] = v
    try:
        options = catalogue.validate_options(method, method_given, require=False)
    except OptionError as err:
        key = next((o.key for o in e.options if f"option {o.key!r}" in str(err)), None)
        raise SimulateError(str(err), key) from None
    d = e.defaults()
    for k in ("labels", "rounds"):
        if run[k] is None:
            run[k] = d[k]
    if run["input_sizes"] is None:
        run["input_sizes"] = tuple(e.input_sizes)
    spec = RunSpec(method=method, options=MappingProxyType(options), **run)
    for check in e.checks:  # the entry's cross-option rules: raise for an error, return a warning line or None
        try:
            w = catalogue.resolve(check)(spec)
        except (OptionError, ValueError) as err:
            raise SimulateError(str(err), getattr(err, "key", None)) from None
        if w:
            warnings.append(w)
    return RunSpec(method=method, options=spec.options, warnings=tuple(warnings), **run)


def check_augment(method: str, augment: str | None) -> None:
    """Refuse an ``augment`` that the generated site configs of ``method`` would refuse, before anything is scanned:
    the prototype methods' sites train on cached tensors (``fast_augment`` of
    :data:`nvflare_jobs.profiles.PROTO_TRAINING`), where a per-image augmentation (``monai``, ``border`` ...
    ``zoom_out``) has no effect. Raises SimulateError naming the option."""
    from nvflare_jobs.profiles import PROTO_TRAINING

    if augment in PER_IMAGE_AUGMENTS and catalogue.is_prototype(method) and PROTO_TRAINING.get("fast_augment"):
        raise SimulateError(f"option 'augment' {augment}: {method}'s sites train on cached tensors (fast_augment: "
                            "true, the prototype methods' training), where a per-image augmentation has no effect; "
                            "drop the option", "augment")


def _drop_foreign(method: str, given: dict, own: set, foreign: dict) -> list[str]:
    """Remove from ``given`` the options of other methods; return a warning line for each given a value other than
    its default. Raises SimulateError for a strict one (an option that must not be silently ignored)."""
    warnings = []
    for key, users in foreign.items():
        if key in own or key in _RUN or key not in given:
            continue
        opt = users[0][1]
        v = given.pop(key)
        if v in ([], opt.argparse_default, opt.default):
            continue
        msg = f"{_shown(key, v)} is not an option of {method} (it is one of {', '.join(m for m, _ in users)})"
        if any(o.strict for _, o in users):
            raise SimulateError(msg, key)
        warnings.append(f"{msg}; ignored")
    return warnings


def _shown(key: str, v) -> str:
    """An option and its value as a caller would give it: ``option 'ot' emd``, a switch as ``option 'gate'`` /
    ``option 'no_gate'`` (the command line shows them as ``--ot emd``, ``--gate``, ``--no-gate``)."""
    return (f"option {key!r}" if v else f"option 'no_{key}'") if isinstance(v, bool) else f"option {key!r} {v}"


def _typed_like(key: str, v, method: str):
    o = option(key)
    if o is None:
        return v
    try:
        return _typed(key, o, v, method) if key in _RUN else check_option(method, o, v)
    except (SimulateError, OptionError):
        return v


def from_dict(d: Mapping[str, Any]) -> RunSpec:
    """The spec of :meth:`RunSpec.to_dict` (resolved and checked again)."""
    d = dict(d)
    return resolve(d.pop("method"), {**{k: v for k, v in d.items() if k not in ("options", "warnings")},
                                     **dict(d.get("options") or {})})


def main(argv: list[str] | None = None) -> int:
    """``python -m nvflare_jobs.spec RUN.json``: the child process of an isolated :meth:`RunSpec.simulate`."""
    from nvflare_jobs.proctree import handle_interrupts

    job_file = Path((argv or sys.argv[1:])[0])
    job = json.loads(job_file.read_text())
    job_file.unlink(missing_ok=True)
    try:
        with handle_interrupts():
            spec = from_dict(job["spec"])
            return spec.simulate(job["out"], overwrite=job["overwrite"], verbose=job["verbose"],
                                 log_config=job["log_config"], gpu=job["gpu"], command=job["command"],
                                 warn=lambda w: print(f"WARNING: {cli_message(w)}", file=sys.stderr)).rc
    except (SimulateError, OSError) as e:
        print(f"cxr-hfl simulate: error: {cli_message(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # run the package's module (not this __main__ copy), so its names are the ones imported
    from nvflare_jobs.spec import main as _main

    sys.exit(_main())
