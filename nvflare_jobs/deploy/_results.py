"""Downloaded jobs into the simulator's run layout, and what a coordinator must read besides the metrics."""
from __future__ import annotations

import json
import os
from pathlib import Path


def run_findings(metrics: dict) -> list[str]:
    """What a coordinator must see besides the metrics of a finished run: the sites the job never reached
    (``not_deployed``), the sites left out (task, round, reason) and the sites whose deployed model predicts a single class for every test image."""
    out = [f"site {site} was NOT part of the job: {why}" for site, why in sorted((metrics.get("not_deployed")
                                                                                  or {}).items())]
    for site, events in (metrics.get("excluded_sites") or {}).items():
        for ev in events:
            out.append(f"site {site} left out of round {ev.get('round')} ({ev.get('task')}): {ev.get('reason')}")
    for site, b in (metrics.get("sites") or {}).items():
        cm = (b.get("test") or {}).get("confusion_matrix")
        if cm and sum(1 for col in zip(*cm) if sum(col) > 0) == 1:
            out.append(f"WARNING: {site}'s deployed model predicts a single class for every test image (confusion "
                       f"matrix {cm}); it has not learned a usable decision rule")
    return out


def _duration_s(meta: dict) -> float:
    d = str(meta.get("duration") or "")
    try:
        h, m, s = d.split(":")
        return int(h) * 3600 + int(m) * 60 + float(s)
    except ValueError:
        return 0.0


def assemble_downloaded(download_dir: str | os.PathLike, run_dir: str | os.PathLike, *, labels_hint: str | None = None,
                        job_meta: dict | None = None) -> dict:
    """Turn a downloaded job (``nvflare job download``) into the simulator's run layout via ``assemble_run``.
    Returns the metrics written, with ``run_dir`` (the folder) added; the job meta's expected sites fill in
    ``expected_sites`` of a record that lacks them."""
    from chest_xray import CLASS_NAMES, scheme_for_num_classes
    from nvflare_jobs.results import assemble_run, find_server_results

    src = find_server_results(download_dir)
    rec = json.loads(src.read_text())
    ncls = {((s.get("model") or {}).get("num_classes")) for s in rec.get("sites", {}).values()} - {None}
    labels = rec.get("labels") or (scheme_for_num_classes(ncls.pop()) if len(ncls) == 1 else None)
    labels = labels or labels_hint or "binary"
    job_meta = job_meta or {}
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    extra = {"job_id": job_meta.get("job_id"), "job_status": job_meta.get("status"),
             "submitter": job_meta.get("submitter_name"), "submitter_role": job_meta.get("submitter_role"),
             "downloaded_from": str(Path(download_dir).resolve())}
    from hfl_components.flare.participation import expected_sites

    if expected_sites(job_meta) and not rec.get("expected_sites"):  # a record from before the server kept them
        named = set(rec.get("sites") or {}) | set(rec.get("excluded") or {}) | set(rec.get("cross_site") or {})
        extra["expected_sites"] = sorted(set(expected_sites(job_meta)) | named)
    if "cross_site" in rec:  # a cross-site evaluation job: its matrix files, no per-site training results
        import shutil

        for name in ("cross_site.json", "cross_site.csv", "cross_site.png"):
            if (src.parent / name).is_file():
                shutil.copy2(src.parent / name, run_dir / name)
        from nvflare_jobs.results import participation

        metrics = {"method": rec.get("method"), "sites": {}, "excluded_sites": rec.get("excluded", {}),
                   **participation(rec),
                   "cross_site": rec["cross_site"], "models": rec.get("models"), "failed": rec.get("failed"), **extra}
        (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
        return {**metrics, "run_dir": str(run_dir)}
    seed = int((rec.get("task_config") or {}).get("seed", 0) or 0)
    metrics = assemble_run(src, run_dir, labels=labels, seed=seed, wall_time_s=_duration_s(job_meta),
                           class_names=CLASS_NAMES[labels], extra=extra)
    return {**metrics, "run_dir": str(run_dir)}
