"""The run-level model index ``RUN/models.json``: which model files a run holds, and what each one is.

``{"run", "job_id", "models": [{"name", "file", "sha256", "bytes", "kind", "site", "method", "seed", "labels",
"input_size", "model", "test", "test_note", "gate"}, ...]}`` (``test_note``: why a model has no test metrics); ``file`` is relative to the run folder. ``cxr-hfl simulate``,
``poc download`` and ``results`` write it (:func:`write_models_index`); ``cxr-hfl status`` shows it.
"""
from __future__ import annotations

import json
from pathlib import Path

INDEX = "models.json"
MODEL_KINDS = ("deployed", "local", "federated")


class ModelIndexError(ValueError):
    """A run's ``models.json`` is unreadable, or a model file is missing or differs from its entry (one line
    naming the file)."""


def _model_files(run: Path) -> list[tuple[Path, str, str | None, str | None]]:
    """``(file, kind, site, group)`` of every model file of a run folder: ``models/<site>_<kind>.pt``, the server's
    ``global_model.pt`` / ``global_fused.pt`` and, for OHFL with several architecture groups,
    ``global_models/<group>[_fused].pt``."""
    out = []
    for f in sorted((run / "models").glob("*.pt")) if (run / "models").is_dir() else []:
        site, _, kind = f.stem.rpartition("_")
        out.append((f, kind, site or None, None))
    for name, kind in (("global_model.pt", "global"), ("global_fused.pt", "fused")):
        if (run / name).is_file():
            out.append((run / name, kind, None, None))
    for f in sorted((run / "global_models").glob("*.pt")) if (run / "global_models").is_dir() else []:
        fused = f.stem.endswith("_fused")
        out.append((f, "fused" if fused else "global", None, f.stem[:-len("_fused")] if fused else f.stem))
    return out


def write_models_index(run_dir: str | Path, metrics: dict) -> Path:
    """Write ``<run>/models.json``: one entry per model file of the run (``models/<site>_<kind>.pt``, the server's
    ``global_model.pt`` / ``global_fused.pt`` and ``global_models/<group>[_fused].pt``) with its name, file,
    SHA-256, size in bytes, kind, site, architecture group, method, seed, input size (pixels), architecture spec,
    the site's test metrics (deployed models) and the site's gate decision (OHFL). POC / provisioned runs hold only
    the server's models (site models stay at the sites). Returns the file."""
    from hfl_components.models.files import file_sha256

    run = Path(run_dir)
    gate = metrics.get("gate") or {}
    adopted, kept = set(gate.get("adopted_sites") or []), set(gate.get("kept_local") or [])
    entries = []
    for f, kind, site, group in _model_files(run):
        b = (metrics.get("sites") or {}).get(site) or {}
        name = f.stem if group is None else f"{kind}-{group}"
        entries.append({
            "name": name, "file": f.relative_to(run).as_posix(), "sha256": file_sha256(f),
            "bytes": f.stat().st_size, "kind": kind, "site": site, "group": group, "method": metrics.get("method"),
            "seed": metrics.get("seed"), "labels": metrics.get("labels"),
            **_described(f, kind, site, group, b, metrics, site in adopted),
            "gate": ("adopted the federated model" if site in adopted else "kept its local model" if site in kept
                     else None) if site and gate else None})
    path = run / INDEX
    path.write_text(json.dumps({"run": run.name, "job_id": metrics.get("job_id"), "models": entries}, indent=1))
    return path


def _described(f: Path, kind: str, site: str | None, group: str | None, block: dict, metrics: dict,
               adopted: bool) -> dict:
    """An index entry's ``model`` (spec), ``input_size`` (pixels) and ``test`` (test-split metrics) from the run's
    metrics, else the model file's own header; a model the run never scored on a test split has ``test`` None
    and ``test_note`` saying why.

    * ``model``: the site's spec; a global model's (``global_specs[group]``, ``global_model``, ``global_spec``);
      else the header's ``spec``.
    * ``input_size``: the site's; else the header's; else (a global model every site runs at its own size) the
      sites' sizes when they are all one.
    * ``test``: a deployed model's site test; a local model's (``local``: OHFL scores it beside the deployed
      one); a federated model the site adopted is its deployed model. A global model is scored only as the sites'
      deployed models, and a federated model a site did not adopt only on validation: ``test_note`` says so.
    """
    try:
        from hfl_components.models.files import read_model_header

        header = read_model_header(f)
    except (OSError, ValueError):
        header = {}
    model = block.get("model") if site else ((metrics.get("global_specs") or {}).get(group) if group else
                                              metrics.get("global_model") or metrics.get("global_spec"))
    sizes = {b.get("input_size") for b in (metrics.get("sites") or {}).values() if isinstance(b, dict)} - {None}
    size = block.get("input_size") or header.get("input_size") or (sizes.pop() if not site and len(sizes) == 1
                                                                    else None)
    test, note = None, None
    if kind == "deployed" or (kind == "federated" and adopted):
        test = block.get("test")
    elif kind == "local":
        test = block.get("local") if isinstance(block.get("local"), dict) and "n" in block["local"] else None
        note = None if test else "the site's local model was not scored on its test split in this run"
    elif kind == "federated":
        note = "not scored on the test split: the site kept its local model (validation: sites.<site>.gate)"
    else:
        note = "a global model is scored at the sites as their deployed models (sites.<site>.test)"
    return {"input_size": size, "model": model or header.get("spec"), "test": test,
            **({"test_note": note} if test is None and note else {})}


def verified_file(run: Path, entry: dict) -> Path:
    """The file of one index entry, checked: inside the run folder, present, with the entry's SHA-256.

    Raises:
        ModelIndexError: one line naming the file (outside the run, missing, or changed since it was indexed).
    """
    from hfl_components.models.files import file_sha256

    index = run / INDEX
    rel = str(entry.get("file") or "")
    f = (run / rel).resolve()
    if not rel or Path(rel).is_absolute() or run.resolve() not in f.parents:
        raise ModelIndexError(f"{index}: entry {entry.get('name')!r} names {rel!r}, not a file inside the run")
    if not f.is_file():
        raise ModelIndexError(f"{run / rel}: listed in {index} but missing")
    if file_sha256(f) != entry.get("sha256"):
        raise ModelIndexError(f"{run / rel}: refused: its SHA-256 differs from its entry in {index} (the file "
                              "changed after the run indexed it)")
    return f


def read_models_index(run_dir: str | Path, log=None) -> list[dict]:
    """The run's model entries (``models.json``), each with ``path``: its file, verified (:func:`verified_file`).

    A run folder from before the index (model files, no ``models.json``) is indexed now from its files and
    ``metrics.json``, and ``log`` (when given) says so.

    Raises:
        ModelIndexError: ``models.json`` unreadable or malformed, or a file outside the run, missing or changed.
    """
    run = Path(run_dir)
    index = run / INDEX
    if not index.is_file() and _model_files(run):
        try:
            metrics = json.loads((run / "metrics.json").read_text())
        except (OSError, ValueError):
            metrics = {}
        write_models_index(run, metrics if isinstance(metrics, dict) else {})
        if log:
            log(f"[cxr-hfl] {run} had no {INDEX}: indexed its {len(_model_files(run))} model files now")
    if not index.is_file():
        return []
    try:
        doc = json.loads(index.read_text())
        entries = doc["models"]
        if not isinstance(entries, list):
            raise TypeError(f"'models' is a {type(entries).__name__}, not a list")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelIndexError(f"{index}: not a model index ({type(e).__name__}: {e})") from None
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("name"), str) or not e.get("file"):
            raise ModelIndexError(f"{index}: models[{i}] is not a model entry (an object with 'name' and 'file'): "
                                  f"{json.dumps(e)[:80]}")
    return [{**e, "path": verified_file(run, e)} for e in entries]


def find_entry(model_file: str | Path) -> tuple[Path, dict] | None:
    """``(run folder, index entry)`` of a model file that an indexed run lists (``RUN/models/<x>.pt``,
    ``RUN/global_model.pt``, ``RUN/global_models/<x>.pt``), its file verified; None for a file no index lists.

    Raises:
        ModelIndexError: the index lists the file with another SHA-256 (one line naming it).
    """
    f = Path(model_file).resolve()
    for run in (f.parent, f.parent.parent):
        index = run / INDEX
        try:
            entries = json.loads(index.read_text())["models"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        for e in entries:
            if isinstance(e, dict) and (run / str(e.get("file") or "")).resolve() == f:
                verified_file(run, e)
                return run, e
    return None
