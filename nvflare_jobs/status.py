"""One status view of a job: a simulator run folder, a POC job or a provisioned deployment's job.

Sources (no NVFlare import for a run folder):

* a simulator run folder: the server's ``cxr_hfl_results/status.json`` under ``<run>/workspace`` (the controller
  rewrites it on every change, ``HFLController.status_snapshot``) and, once the run ended, ``metrics.json``;
* a POC or provisioned job: NVFlare's admin API (``nvflare.fuel.flare_api``) with the caller's startup kit: the
  job's meta (status), the server's ``show_stats`` (the same snapshot, group ``cxr_hfl``) and the connected sites
  (``check_status``).

:func:`job_view` turns a snapshot into the view: the job state, the current round and task, per site its state
(``connected``, ``training``, ``answered``, ``late``, ``excluded``, ``not connected``), seconds since its last
heartbeat, task/epoch/loss, its latest validation metrics, and the gate's decisions when done.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from hfl_components.flare.catalogue import record_summary


INTERRUPTED = "interrupted"  # the phase the CLI writes into status.json when Ctrl-C / SIGTERM stopped a run
SITE_STATES = ("training", "late", "answered", "excluded", "connected", "not connected", "done", "stopped", "unknown")


def _read(path: Path) -> dict | None:
    """``path``'s JSON object, or None when it is absent, unreadable or not a JSON object."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


FINAL_TASK = "evaluate"  # every method's last task (catalogue.COMMON_SITE_HANDLERS): the final evaluation


def step(method: str | None, task: str | None, rnd, num_rounds) -> str | None:
    """Where a job is, in its own terms, when the controller's round number would mislead, else None (the round
    number says it). The last task, ``evaluate``, is the ``final evaluation``, not a round (its round number is one
    past the last training round). A method on the ``ensemble`` schedule (FENS: one upload in its ``local phase``,
    round 0, then ``num_rounds`` aggregator rounds numbered from 1, and one last call that only installs the final
    aggregator, round ``num_rounds`` + 1) is worded ``local phase``, ``aggregator round r of R`` and ``installing
    the final aggregator``."""
    from hfl_components.flare.catalogue import CATALOGUE

    if not task:
        return None
    if task == FINAL_TASK:
        return "final evaluation"
    entry = CATALOGUE.get(method or "")
    if entry is None or entry.schedule != "ensemble" or not isinstance(rnd, int):
        return None
    if task == entry.training_task:
        return "local phase"
    if isinstance(num_rounds, int) and rnd > num_rounds:
        return "installing the final aggregator"
    return f"aggregator round {rnd} of {num_rounds}"


def job_view(snapshot: dict | None, *, job_state: str, sites: list[str] | None = None,
             connected: dict[str, float | None] | None = None, job_id: str | None = None) -> dict:
    """The status view of one job.

    Args:
        snapshot: the controller's status snapshot (``status.json`` / ``show_stats``), or None before it runs.
        job_state: NVFlare's job status (``RUNNING``, ``FINISHED:COMPLETED``, ...) or the simulator's equivalent.
        sites: the job's sites (default: those the snapshot names).
        connected: {site: seconds since its last heartbeat to the server (None: unknown)} of the sites connected
            now, when known (POC / provisioned); None for a simulator run.
    Returns:
        ``{"job_id", "job_state", "phase", "round", "num_rounds", "task", "step", "failed", "sites": {site:
        {"state", "reason", "heard_s_ago", "task", "round", "step", "stage", "epoch", "epochs", "loss", "val"}},
        "gate"}`` (``step``: :func:`step`; a site's ``val`` from the final evaluation carries ``step`` too).
    """
    st = snapshot or {}
    prog = st.get("sites") or {}
    excluded = st.get("excluded") or {}
    names = list(sites or []) or sorted(set(prog) | set(excluded) | set(st.get("waiting_for") or [])
                                        | set(st.get("answered") or []) | set(connected or {}))
    waiting = set(st.get("waiting_for") or [])
    answered = set(st.get("answered") or [])
    dropped_now = st.get("dropped_now") or {}
    finished = str(job_state).upper().startswith("FINISHED") or st.get("phase") in ("done", "failed")
    late = st.get("late_wait_ends_in_s") is not None
    out = {}
    for s in names:
        p = prog.get(s) or {}
        reason = dropped_now.get(s) or excluded.get(s)
        if s in dropped_now or (s in excluded and s not in waiting and s not in answered):
            state = "excluded"
        elif connected is not None and s not in connected and not finished:
            state = "not connected"
        elif st.get("phase") == INTERRUPTED:
            state = "stopped"
        elif finished:
            state = "done"
        elif s in waiting:
            state = "late" if late and answered else "training"
        elif s in answered:
            state = "answered"
        elif connected is not None:
            state = "connected"
        else:
            state = "unknown"
        heard = p.get("heard_s_ago")
        if connected is not None and connected.get(s) is not None and heard is None:
            heard = connected[s]
        out[s] = {"state": state, "reason": reason if state == "excluded" or s in excluded else None,
                  "heard_s_ago": heard, "task": p.get("task"), "round": p.get("round"),
                  "step": step(st.get("method"), p.get("task"), p.get("round"), st.get("num_rounds")),
                  "stage": p.get("stage"), "epoch": p.get("epoch"), "epochs": p.get("epochs"), "loss": p.get("loss"),
                  "val": _val(st, s)}
    return {"job_id": job_id, "job_state": job_state, "phase": st.get("phase"), "round": st.get("round"),
            "num_rounds": st.get("num_rounds"), "task": st.get("task"),
            "step": step(st.get("method"), st.get("task"), st.get("round"), st.get("num_rounds")),
            "method": st.get("method"),
            "failed": st.get("failed"), "sites": out, "gate": st.get("gate") if finished else None}


def _val(st: dict, site: str) -> dict | None:
    """A site's latest validation metrics of the snapshot; from the final evaluation (the server's current task is
    it, in the same round) with ``step``: ``final evaluation``."""
    val = (st.get("latest_val") or {}).get(site)
    if isinstance(val, dict) and st.get("task") == FINAL_TASK and val.get("round") == st.get("round"):
        return {**val, "step": "final evaluation"}
    return val


def run_folder_view(run_dir: str | Path) -> dict:
    """The view of a simulator run folder (``cxr-hfl simulate --out``), running or finished.

    Raises:
        FileNotFoundError: the folder holds no simulator run (no ``workspace`` and no ``metrics.json``), or its
            only source, ``metrics.json``, is not a JSON object (truncated or edited); the message names the file.
    """
    run = Path(run_dir)
    metrics = _read(run / "metrics.json")
    found = sorted((run / "workspace").rglob("cxr_hfl_results/status.json")) if (run / "workspace").is_dir() else []
    if metrics is None and not found:
        if (run / "metrics.json").exists():
            raise FileNotFoundError(f"{run / 'metrics.json'}: not a readable JSON object (truncated or edited?)")
        runs = sorted(p.parent for p in run.glob("seed*/*/metrics.json"))
        if (run / "compare.json").is_file():
            raise FileNotFoundError(f"{run} is a cxr-hfl compare folder, not one run; give one of its runs, e.g. "
                                    f"{runs[0] if runs else run / 'seed0' / '<method>'}")
        raise FileNotFoundError(f"{run} holds no simulator run (no metrics.json, no workspace/**/status.json)")
    snap = _read(found[0]) if found else None
    if metrics is not None:
        state = "FINISHED:FAILED" if metrics.get("failed") else "FINISHED:COMPLETED"
        if snap is None:
            snap = {"phase": "failed" if metrics.get("failed") else "done", "method": metrics.get("method"),
                    "excluded": {s: ev[-1].get("reason") for s, ev in (metrics.get("excluded_sites") or {}).items()},
                    "gate": metrics.get("gate"), "failed": metrics.get("failed")}
        snap.setdefault("gate", metrics.get("gate"))
        sites = sorted(set(metrics.get("sites") or {}) | set(metrics.get("excluded_sites") or {}))
    else:
        phase = (snap or {}).get("phase")
        state = {"done": "FINISHED:COMPLETED", "failed": "FINISHED:FAILED",
                 INTERRUPTED: "STOPPED (interrupted: Ctrl-C or SIGTERM stopped the run)"}.get(phase, "RUNNING")
        if state == "RUNNING" and snap and time.time() - float(snap.get("time") or 0) > 120:
            state = "STOPPED (no update for over 2 minutes: the run was interrupted or crashed)"
        if snap is None:  # the server writes it atomically: unreadable means damaged, not mid-write
            state = f"UNKNOWN ({found[0]}: not a readable JSON object; truncated or edited?)"
        if snap and snap.get("time"):  # heartbeats as old as they are now, not when the snapshot was written
            age = max(0.0, time.time() - float(snap["time"]))
            for p in (snap.get("sites") or {}).values():
                if isinstance(p, dict) and isinstance(p.get("heard_s_ago"), (int, float)):
                    p["heard_s_ago"] = round(p["heard_s_ago"] + age, 1)
        sites = None
    view = job_view(snap, job_state=state, sites=sites, job_id=run.name)
    view["source"] = str(found[0]) if found else str(run / "metrics.json")
    tb = sorted({str(p.parent.parent) for p in (run / "workspace").rglob("events.out.tfevents.*")}) \
        if (run / "workspace").is_dir() else []
    view["tensorboard"] = tb[0] if tb else None
    # the method's own record fields, as its catalogue entry declares them (catalogue.record_summary)
    view["record"] = record_summary(metrics.get("method"), metrics) if metrics else []
    if metrics and isinstance(metrics.get("sites"), dict):  # whether the run was DP, and at which epsilon
        from hfl_components.privacy import run_dp_line

        view["record"].append(("privacy", run_dp_line(metrics["sites"])))
    idx = _read(run / "models.json")
    entries = [e for e in ((idx or {}).get("models") or []) if isinstance(e, dict)]
    view["models"] = [{k: e.get(k) for k in ("name", "kind", "site", "sha256", "gate")} for e in entries]
    # a half-copied or damaged run folder: what evaluate / predict will refuse, said here first
    view["models_missing"] = [str(e["file"]) for e in entries
                              if isinstance(e.get("file"), str) and not (run / e["file"]).is_file()]
    view["models_index_unreadable"] = (run / "models.json").is_file() and idx is None
    return view


def mark_interrupted(out_dir: str | Path) -> int:
    """After Ctrl-C / SIGTERM stopped a simulator run (or a comparison's current run): set ``phase`` to
    :data:`INTERRUPTED` in every unfinished ``workspace/**/cxr_hfl_results/status.json`` under ``out_dir``, so
    that ``cxr-hfl status`` says so at once instead of showing the last live state. Returns how many it marked."""
    n = 0
    for f in Path(out_dir).glob("**/workspace/**/cxr_hfl_results/status.json") if Path(out_dir).is_dir() else []:
        snap = _read(f)
        if snap is None or snap.get("phase") in ("done", "failed", INTERRUPTED):
            continue
        snap["phase"] = INTERRUPTED
        tmp = f.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(snap))
        tmp.replace(f)
        n += 1
    return n


def admin_view(session, job_id: str) -> dict:
    """The view of a POC / provisioned job through an open ``flare_api`` session (the caller's startup kit)."""
    meta = session.get_job_meta(job_id) or {}
    state = str(meta.get("status") or "UNKNOWN")
    snap = None
    if state.upper().startswith("RUNNING"):
        try:
            stats = session.show_stats(job_id, "server") or {}
            snap = (stats.get("server") or {}).get("cxr_hfl")
        except Exception:  # noqa: BLE001 - the job may be starting or ending
            snap = None
    connected = None
    try:
        from nvflare.fuel.flare_api.api_spec import TargetType

        info = session.check_status(TargetType.SERVER) or {}
        connected = {}
        for c in info.get("clients") or []:  # [{"client_name", "client_last_conn_time", "fqcn"}]
            last = c.get("client_last_conn_time")
            if c.get("client_name"):
                connected[c["client_name"]] = (None if not isinstance(last, (int, float))
                                               else round(max(0.0, time.time() - last), 1))
    except Exception:  # noqa: BLE001 - the view still shows the job
        connected = None
    dm = meta.get("deploy_map") or {}
    sites = sorted({s for t in dm.values() for s in t if s != "server" and not str(s).startswith("@")}) or None
    view = job_view(snap, job_state=state, sites=sites, connected=connected, job_id=job_id)
    view["submitter"] = meta.get("submitter_name")
    return view


def format_site(site: str, d: dict, heard: bool = True) -> str:
    """One site's line of the view: name, state, seconds since its last heartbeat (``heard``), task, round, stage,
    epoch and loss, its latest validation metric and, when excluded, the reason. The simulator's live console
    (:class:`nvflare_jobs.progress.LiveProgress`) prints the same line without the heartbeat age."""
    from nvflare_jobs.progress import describe_site  # the live console's wording of a site's heartbeat

    parts = [f"{site:<14}{d['state']:<14}"]
    if heard and d.get("heard_s_ago") is not None and d["state"] != "done":
        parts.append(f"heard {d['heard_s_ago']:.0f} s ago")
    if d.get("task"):
        parts.append(describe_site(d))
    val = d.get("val") or {}
    m = next((k for k in ("balanced_accuracy", "accuracy", "auc") if isinstance(val.get(k), (int, float))), None)
    if m:
        parts.append(f"val {m} {val[m]:.3f} ({val.get('step') or 'round ' + str(val.get('round'))})")
    if d.get("reason"):
        parts.append(f"excluded: {d['reason']}")
    return "  ".join(parts).rstrip()


def format_view(v: dict) -> str:
    """The view as console lines (``cxr-hfl status``, ``poc status``, and the simulator's console at the end)."""
    head = f"job {v.get('job_id')}: {v.get('job_state')}"
    if v.get("method"):
        head += f" ({v['method']})"
    if v.get("task"):
        where = v.get("step") or f"round {v.get('round')}"
        head += f"; {where} task {v['task']} ({v.get('phase')})"
    lines = [head]
    if v.get("failed"):
        lines.append(f"  FAILED: {v['failed']}")
    lines += ["  " + format_site(s, d) for s, d in v["sites"].items()]
    record = v.get("record") or []
    lines += [f"  {label}: {text}" for label, text in record]
    g = v.get("gate")
    if g and not any(label == "gate" for label, _ in record):
        lines.append("  gate: " + json.dumps(g, default=str)[:400])
    if v.get("models"):
        lines.append(f"  models: {len(v['models'])} files (models.json): "
                     + ", ".join(m["name"] for m in v["models"][:8]) + (" ..." if len(v["models"]) > 8 else ""))
    if v.get("models_missing"):
        lines.append(f"  MISSING: {len(v['models_missing'])} model file(s) listed in models.json: "
                     + ", ".join(v["models_missing"][:4]) + (" ..." if len(v["models_missing"]) > 4 else "")
                     + " (evaluate refuses the run until they are restored)")
    if v.get("models_index_unreadable"):
        lines.append("  models.json: unreadable (truncated or edited?); evaluate refuses the run until it is "
                     "restored or removed (then it is rebuilt from the model files)")
    if v.get("tensorboard"):
        lines.append(f"  TensorBoard: tensorboard --logdir {v['tensorboard']}")
    return "\n".join(lines)
