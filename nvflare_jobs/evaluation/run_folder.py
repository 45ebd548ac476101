"""What :mod:`nvflare_jobs.evaluation` reads from a run folder: its site manifests and rows, saved models, input
sizes, label scheme and aspect, and the leakage guards (file names / patient ids shared with an external set, the
OHFL probe pool)."""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from chest_xray.io import SUPPORTED_SUFFIXES


class LeakageError(RuntimeError):
    """The external set shares file names or patient ids with the run's training data."""


# ----------------------------------------------------------------------------------------------- run contents
def site_configs(run: Path) -> dict[str, dict]:
    """Site -> the config it ran with (``RUN/resolved_configs/<site>.json``); {} for a run folder without them.

    Raises:
        ValueError: one line naming a file that is unreadable or not a JSON object (truncated or edited): the
            sizes, aspect and training manifests of the run would otherwise be taken from the other sites alone.
    """
    out: dict[str, dict] = {}
    for f in sorted((Path(run) / "resolved_configs").glob("*.json")):
        try:
            cfg = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{f}: not readable as JSON ({type(e).__name__}: {str(e).splitlines()[0]}); the "
                             "run's resolved site config was truncated or edited") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{f}: expected a JSON object (a resolved site config), found {type(cfg).__name__}")
        out[f.stem] = cfg
    return out


def _config_size(f: str, cfg: dict) -> int | None:
    """A resolved config's ``input_size``; None when it has none. Raises ValueError naming ``f`` for a value
    that is not a whole number."""
    v = cfg.get("input_size")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{f}: input_size {v!r} is not a whole number of pixels (edited?)")
    return v


def run_manifests(run: Path) -> dict[str, Path]:
    """Site -> manifest CSV the run trained on: ``resolved_configs/<site>.json`` (data.manifest), else (a run
    folder moved from where it ran) ``partition/sites/<site>.csv``; a run without resolved configs: every
    ``partition/sites/*.csv``. A site whose manifest is in neither place is left out (see
    :func:`missing_run_manifests`). Raises ValueError: see :func:`site_configs`."""
    run = Path(run)
    out: dict[str, Path] = {}
    configs = site_configs(run)
    for site, cfg in configs.items():
        man = cfg.get("data", {}).get("manifest") if isinstance(cfg.get("data"), dict) else None
        local = run / "partition" / "sites" / f"{site}.csv"
        if isinstance(man, str) and Path(man).is_file():
            out[site] = Path(man)
        elif local.is_file():
            out[site] = local
    if not configs:
        for f in sorted((run / "partition" / "sites").glob("*.csv")):
            out[f.stem] = f
    return out


def missing_run_manifests(run: Path) -> list[str]:
    """The run's sites (``resolved_configs/``, else ``metrics.json``) whose training manifest
    :func:`run_manifests` cannot find: the leakage check cannot see their images."""
    sites = list(site_configs(run)) or list((run_metrics(run).get("sites") or {}))
    found = run_manifests(run)
    return [s for s in sites if s not in found]


def site_rows(run: Path) -> dict[str, list[dict]]:
    from chest_xray import read_site_manifest

    return {s: read_site_manifest(p) for s, p in run_manifests(run).items()}


def run_metrics(run: Path, name: str = "metrics.json") -> dict:
    """The run's ``metrics.json`` (or another JSON file ``name`` of the run folder); {} when it has none.

    Raises:
        ValueError: one line naming the file when it is unreadable or not a JSON object (truncated, edited).
    """
    p = Path(run) / name
    if not p.is_file():
        return {}
    try:
        m = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{p}: not readable as JSON ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    if not isinstance(m, dict):
        raise ValueError(f"{p}: expected a JSON object, found {type(m).__name__}")
    return m


def run_input_sizes(run: Path) -> list[int]:
    """The input sizes of a run's sites, smallest first. Raises ValueError: see :func:`site_configs`."""
    sizes = set(run_site_sizes(run).values())
    if not sizes:
        sizes = set(run_site_sizes(run).values())
    return sorted(sizes)


def run_labels(run: Path) -> str | None:
    return run_metrics(run).get("labels")


def load_model_file(path: str | Path):
    """``(model in eval mode, header)`` of a model file; see :func:`hfl_components.models.load_model_file`."""
    from hfl_components.models import load_model_file as _load

    return _load(path)


def list_run_models(run: Path, global_sizes: str = "all", log=None) -> list[dict[str, Any]]:
    """Every model of a run's ``models.json`` (:func:`nvflare_jobs.models_index.read_models_index`: each file
    checked against its SHA-256) as ``{"name", "path", "kind", "site", "input_size"}``.

    ``kind`` is ``deployed``, ``local``, ``federated``, ``global`` or ``fused``; a global model (no input size of its
    own) is listed once per input size its sites used (``global_sizes="all"``) or once at the largest
    (``"largest"``); a global model whose file records an input size of its own (FENS's ensemble) is listed once, at
    that size. A run without ``models.json`` is indexed first (``log`` says so).

    Raises:
        ModelIndexError (a ValueError): a model file missing or differing from its index entry, naming it.
    """
    from hfl_components.models.files import read_model_header
    from nvflare_jobs.models_index import read_models_index

    run = Path(run)
    all_sizes = run_input_sizes(run) or [64]
    site_sizes, groups = run_site_sizes(run), run_groups(run)
    out = []
    for e in read_models_index(run, log):
        kind, group = e.get("kind"), e.get("group")
        if kind not in ("global", "fused"):
            out.append({"name": e["name"], "path": e["path"], "kind": kind, "site": e.get("site"),
                        "input_size": None})
            continue
        try:
            own = read_model_header(e["path"]).get("input_size") if group is None else None
        except (ValueError, OSError):  # refused with its one line by the header check that follows
            own = None
        sizes = sorted({site_sizes[s] for s in groups.get(group, []) if s in site_sizes}) or all_sizes
        for s in ([own] if own else sizes[-1:] if global_sizes == "largest" else sizes):
            out.append({"name": f"{kind}_{s}px" if group is None else f"{kind}-{group}_{s}px", "path": e["path"],
                        "kind": kind, "site": None, "input_size": s, **({"group": group} if group else {}),
                        **({"own_size": True} if own else {})})
    return out


def run_groups(run: Path) -> dict[str, list[str]]:
    """{architecture group: its sites} of an OHFL run with several groups (``global_models/groups.json``); {}
    otherwise."""
    p = Path(run) / "global_models" / "groups.json"
    if not p.is_file():
        return {}
    return {g: list(v.get("sites", [])) for g, v in json.loads(p.read_text()).items()}


# ----------------------------------------------------------------------------------------------- leakage
def name_key(path: str) -> str:
    """The key the leakage checks match images on: the file name of ``path``, lower case."""
    return Path(path).name.lower()


def training_overlap(run: Path, records: list[dict]) -> dict[str, Any]:
    """File names and patient ids the external ``records`` share with the run's site manifests (all splits)."""
    rows = [r for rs in site_rows(run).values() for r in rs]
    names = {name_key(r["path"]) for r in rows}
    pids = {str(r["patient_id"]) for r in rows if r.get("patient_id")}
    shared_names = sorted({name_key(r["path"]) for r in records} & names)
    shared_pids = sorted({str(r["patient_id"]) for r in records if r.get("patient_id")} & pids)
    n_img = sum(1 for r in records if name_key(r["path"]) in names or str(r.get("patient_id")) in pids)
    return {"n_run_rows": len(rows), "shared_file_names": len(shared_names), "shared_patient_ids": len(shared_pids),
            "n_external_images_affected": n_img, "examples": (shared_names[:5] + shared_pids[:5])}


def _probe_part(source: str) -> str | None:
    """``"probe"`` when ``source`` names the committed probe part: ``probe``, ``part:probe``,
    ``chest_xray_224:probe`` or the committed list ``chest_xray/splits/chest_xray_224_probe.csv`` itself."""
    from chest_xray.splits import POOL

    s = str(source)
    if s in ("probe", "part:probe", f"{POOL}:probe") or Path(s).name == f"{POOL}_probe.csv":
        return "probe"
    return None


def probe_pool(run: Path) -> tuple[set[str], str | None]:
    """File names (lower case) of every image the run's OHFL server could draw its probe from, and the source.

    The source is ``job_options.json``'s ``probe``: a folder (every image under it; the root of the shared
    ``chest_xray_224`` pool stands for its committed ``probe`` part, as the server reads it), a CSV (its ``path``
    column, e.g. a partition's probe.csv or the committed ``chest_xray_224_probe.csv``), or the committed ``probe``
    part named as ``probe`` / ``part:probe``. File names the server recorded as used (``metrics.json`` ->
    ``probe.files``) are added. A run without a probe (not OHFL, or ``generated`` inputs) gives an empty set. Whole
    pools are left out, not only the images one draw took: the server may have drawn any of them.

    Raises:
        FileNotFoundError: the recorded probe folder / CSV no longer exists (the exclusion cannot be honoured).
    """
    from chest_xray.splits import POOL, split_rows

    run = Path(run)
    used: set[str] = set()
    if (run / "metrics.json").is_file():
        rec = run_metrics(run).get("probe")
        if isinstance(rec, dict):
            used = {name_key(str(f)) for f in rec.get("files") or []}
    opts = run / "job_options.json"
    if not opts.is_file():
        return used, None
    probe = run_metrics(run, "job_options.json").get("probe")
    if not probe or probe in ("generated", "none"):  # generated inputs, or no probe pool (data-free)
        return used, probe
    p = Path(probe)
    part = {name_key(r["path"]) for r in split_rows("probe")}
    if _probe_part(probe):
        return part | used, str(probe)
    if p.is_dir() and p.name == POOL and any((p / r["path"]).is_file() for r in split_rows("probe")[:20]):
        return part | used, f"{p} (its committed probe part)"
    if p.is_file():
        with open(p, newline="", encoding="utf-8", errors="surrogateescape") as fh:  # as write_partition wrote it
            return {name_key(r.get("path", "")) for r in csv.DictReader(fh) if r.get("path")} | used, str(p)
    if p.is_dir():
        return {f.name.lower() for f in p.rglob("*") if f.suffix.lower() in SUPPORTED_SUFFIXES} | used, str(p)
    raise FileNotFoundError(f"{run}: the probe pool its server used ({probe}) no longer exists, so its images "
                            "cannot be left out of the evaluation; restore it or evaluate on a set without them")


def probe_overlap(run: Path, records: list[dict]) -> int:
    """Number of external images whose file name is in the run's OHFL probe pool (:func:`probe_pool`)."""
    names, _ = probe_pool(run)
    return sum(1 for r in records if name_key(r["path"]) in names)


# ----------------------------------------------------------------------------------------------- evaluation
def model_aspect(header: dict, run: Path | None = None) -> str:
    """How to make images square for a model: its file's ``aspect`` (the site-config key it was trained with),
    else -- a global model, which has none of its own -- the one aspect every site of ``run`` used
    (``resolved_configs/<site>.json``), else ``chest_xray.DEFAULT_ASPECT`` (files written before it was recorded)."""
    from chest_xray import DEFAULT_ASPECT

    if header.get("aspect"):
        return header["aspect"]
    if run is not None:
        seen = {cfg.get("aspect") or DEFAULT_ASPECT for cfg in site_configs(run).values()}
        if len(seen) == 1:
            return seen.pop()
    return DEFAULT_ASPECT


def run_site_sizes(run: Path) -> dict[str, int]:
    """Site -> input size of a run (``resolved_configs/<site>.json``, else metrics.json). Raises ValueError: see
    :func:`site_configs`."""
    out: dict[str, int] = {}
    for site, cfg in site_configs(run).items():
        if (v := _config_size(str(Path(run) / "resolved_configs" / f"{site}.json"), cfg)) is not None:
            out[site] = v
    if not out:
        sites = run_metrics(run).get("sites")
        out = {s: int(b["input_size"]) for s, b in (sites if isinstance(sites, dict) else {}).items()
               if isinstance(b, dict) and b.get("input_size")}
    return out
