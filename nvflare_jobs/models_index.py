"""The run-level model index ``RUN/models.json``: which model files a run holds, and what each one is.

``{"run", "job_id", "models": [{"name", "file", "sha256", "bytes", "kind", "site", "method", "seed", "labels",
"input_size", "model", "test", "gate"}, ...]}``; ``file`` is relative to the run folder. ``cxr-hfl simulate``,
``poc download`` and ``results`` write it (:func:`write_models_index`); ``cxr-hfl status`` shows it.
"""
from __future__ import annotations

import json
from pathlib import Path

MODEL_KINDS = ("deployed", "local", "federated")


def write_models_index(run_dir: str | Path, metrics: dict) -> Path:
    """Write ``<run>/models.json``: one entry per model file of the run (``models/<site>_<kind>.pt``, and the
    server's ``global_model.pt``) with its name, file, SHA-256, size in bytes, kind, site, method, seed, input size
    (pixels), architecture spec, the site's test metrics (deployed models) and the site's gate decision (OHFL).
    POC / provisioned runs hold only the server's models (site models stay at the sites). Returns the file."""
    import hashlib

    run = Path(run_dir)
    gate = metrics.get("gate") or {}
    adopted, kept = set(gate.get("adopted_sites") or []), set(gate.get("kept_local") or [])
    files = sorted((run / "models").glob("*.pt")) if (run / "models").is_dir() else []
    if (run / "global_model.pt").is_file():
        files.append(run / "global_model.pt")
    entries = []
    for f in files:
        site, _, kind = f.stem.rpartition("_")
        if f.name == "global_model.pt":
            site, kind = None, "global"
        b = (metrics.get("sites") or {}).get(site) or {}
        entries.append({
            "name": f.stem, "file": str(f.relative_to(run)), "sha256": hashlib.sha256(f.read_bytes()).hexdigest(),
            "bytes": f.stat().st_size, "kind": kind, "site": site, "method": metrics.get("method"),
            "seed": metrics.get("seed"), "labels": metrics.get("labels"),
            "input_size": b.get("input_size"), "model": b.get("model") if site else metrics.get("global_model"),
            "test": b.get("test") if kind == "deployed" else None,
            "gate": ("adopted the federated model" if site in adopted else "kept its local model" if site in kept
                     else None) if site and gate else None})
    path = run / "models.json"
    path.write_text(json.dumps({"run": run.name, "job_id": metrics.get("job_id"), "models": entries}, indent=1))
    return path

