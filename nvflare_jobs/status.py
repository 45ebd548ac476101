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
SITE_STATES = ("training", "late", "answered", "excluded", "connected", "not connected", "done", "stopped", "unknown",
               "took part", "not deployed", "missing")  # the last three: a finished job's truth (site_truth)


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
             connected: dict[str, float | None] | None = None, job_id: str | None = None,
             record: dict | None = None) -> dict:
    """The status view of one job.

    Args:
        snapshot: the controller's status snapshot (``status.json`` / ``show_stats``), or None before it runs.
        job_state: NVFlare's job status (``RUNNING``, ``FINISHED:COMPLETED``, ...) or the simulator's equivalent.
        sites: the job's sites (default: those the snapshot names).
        connected: {site: seconds since its last heartbeat to the server (None: unknown)} of the sites connected
            now, when known (POC / provisioned); None for a simulator run.
        record: the finished job's record (``metrics.json`` or the server's ``server_results.json``); default the
            snapshot's ``final`` part. For a finished job each site's state is then its part in the job
            (:func:`site_truth`), never a bare ``done``.
    Returns:
        ``{"job_id", "job_state", "phase", "round", "num_rounds", "task", "step", "failed", "server_progress",
        "sites": {site: {"state", "reason", "heard_s_ago", "task", "round", "step", "stage", "epoch", "epochs",
        "loss", "val", "waiting_for_server"}}, "gate"}`` (``step``: :func:`step`; a site's ``val`` from the final
        evaluation carries ``step`` too; a finished job's sites also carry :func:`site_truth`'s ``exclusions``,
        ``test`` and ``decision``).
    """
    st = snapshot or {}
    finished = str(job_state).upper().startswith("FINISHED") or st.get("phase") in ("done", "failed")
    record = record if record is not None else (st.get("final") if finished else None)
    truth = site_truth(record) if isinstance(record, dict) else {}
    not_deployed = {**(st.get("not_deployed") or {}), **{s: t["reason"] for s, t in truth.items()
                                                         if t["state"] == "not deployed"}}
    names = list(sites or []) or sorted(set(st.get("sites") or {}) | set(st.get("excluded") or {})
                                        | set(st.get("waiting_for") or []) | set(st.get("answered") or [])
                                        | set(connected or {}) | set(st.get("expected_sites") or [])
                                        | set(not_deployed))
    names += [s for s in sorted(set(truth) | set(not_deployed)) if s not in names]
    out = {s: _site_entry(st, s, finished, connected, not_deployed) for s in names}
    for s in out if truth else ():  # a site the record names nowhere (e.g. one deploy_map names) is missing
        t = truth.get(s) or {"state": "missing", "reason": MISSING, "exclusions": [], "test": None, "decision": None}
        out[s].update(state=t["state"], reason=t["reason"], exclusions=t["exclusions"], test=t["test"],
                      decision=t["decision"])
    return {"job_id": job_id, "job_state": job_state, "phase": st.get("phase"), "round": st.get("round"),
            "num_rounds": st.get("num_rounds"), "task": st.get("task"),
            "step": step(st.get("method"), st.get("task"), st.get("round"), st.get("num_rounds")),
            "method": st.get("method") or (record or {}).get("method"), "failed": st.get("failed"),
            "server_progress": None if finished else st.get("server_progress"), "sites": out,
            "gate": (st.get("gate") or (record or {}).get("gate")) if finished else None}


SERVER_WAIT_PHASES = ("waiting", "starting", "done", "failed", INTERRUPTED)


def _site_entry(st: dict, s: str, finished: bool, connected: dict | None, not_deployed: dict) -> dict:
    """One site's live entry of :func:`job_view` from the snapshot ``st``."""
    p = (st.get("sites") or {}).get(s) or {}
    excluded = st.get("excluded") or {}
    waiting, answered = set(st.get("waiting_for") or []), set(st.get("answered") or [])
    dropped_now = st.get("dropped_now") or {}
    reason = dropped_now.get(s) or excluded.get(s) or not_deployed.get(s)
    if s in not_deployed:
        state = "not deployed"
    elif s in dropped_now or (s in excluded and s not in waiting and s not in answered):
        state = "excluded"
    elif connected is not None and s not in connected and not finished:
        state = "not connected"
    elif st.get("phase") == INTERRUPTED:
        state = "stopped"
    elif finished:
        state = "done"
    elif s in waiting:
        state = "late" if st.get("late_wait_ends_in_s") is not None and answered else "training"
    elif s in answered:
        state = "answered"
    else:
        state = "connected" if connected is not None else "unknown"
    heard = p.get("heard_s_ago")
    if connected is not None and connected.get(s) is not None and heard is None:
        heard = connected[s]
    return {"state": state, "reason": reason if state in ("excluded", "not deployed") or s in excluded else None,
            "heard_s_ago": heard, "task": p.get("task"), "round": p.get("round"),
            "step": step(st.get("method"), p.get("task"), p.get("round"), st.get("num_rounds")),
            "stage": p.get("stage"), "epoch": p.get("epoch"), "epochs": p.get("epochs"), "loss": p.get("loss"),
            "val": _val(st, s),
            # an answered site while the server works (fusion, distillation): quiet by design, not stale
            "waiting_for_server": state == "answered" and st.get("phase") not in SERVER_WAIT_PHASES}


TEST_KEYS = ("balanced_accuracy", "auc", "accuracy")
MISSING = "expected, but the job's record names it nowhere (never deployed to or never answered)"


def site_truth(record: dict) -> dict[str, dict]:
    """Each site's part in a finished job, from its record: ``metrics.json`` (``excluded_sites``) or the server's
    ``server_results.json`` / the final status snapshot (``excluded``), with ``expected_sites`` and
    ``not_deployed`` where the job recorded them.

    Returns:
        {site: {"state", "reason", "exclusions", "test", "decision"}}: ``state`` is ``took part`` (it answered the
        final evaluation, or has a row of a cross-site evaluation; ``exclusions`` lists any earlier round it was
        left out of), ``excluded`` (left out and
        never evaluated; ``reason`` the last exclusion's), ``not deployed`` (the job never reached it; ``reason``)
        or ``missing`` (expected, but the record names it nowhere); ``exclusions`` = [{"round", "task",
        "reason"}]; ``test`` = its final test metrics ({balanced_accuracy, auc, accuracy}) or None; ``decision`` =
        its gate or acceptance decision in words, or None.
    """
    blocks = record.get("sites") or {}
    rows = record.get("cross_site") if isinstance(record.get("cross_site"), dict) else {}
    excluded = record.get("excluded_sites", record.get("excluded")) or {}
    not_dep = record.get("not_deployed") or {}
    names = sorted(set(record.get("expected_sites") or []) | set(blocks) | set(excluded) | set(not_dep) | set(rows))
    out = {}
    for s in names:
        events = [{"round": e.get("round"), "task": e.get("task"), "reason": e.get("reason")}
                  for e in (excluded.get(s) or []) if isinstance(e, dict)]
        b = blocks.get(s) if isinstance(blocks.get(s), dict) else None
        if s in not_dep:
            state, reason = "not deployed", not_dep[s]
        elif isinstance((b or {}).get("test"), dict) or s in rows:  # it answered the final evaluation
            state, reason = "took part", None
        elif events:
            state, reason = "excluded", events[-1]["reason"]
        else:
            state, reason = "missing", MISSING
        test = (b or {}).get("test") if isinstance((b or {}).get("test"), dict) else None
        out[s] = {"state": state, "reason": reason, "exclusions": events,
                  "test": {k: test[k] for k in TEST_KEYS if isinstance(test.get(k), (int, float))} if test else None,
                  "decision": _decision(b or {})}
    return out


def _decision(block: dict) -> str | None:
    """A site's gate (``{"adopted", "reason"}``) or acceptance (``{"outcome"}``) decision in words, or None."""
    acc, gate = block.get("acceptance"), block.get("gate")
    if isinstance(acc, dict) and acc.get("outcome"):
        return f"acceptance: {acc['outcome']}"
    if isinstance(gate, dict) and "adopted" in gate:
        return "gate: adopted the federated model" if gate["adopted"] else \
            "gate: kept its local model" + (f" ({gate['reason']})" if gate.get("reason") else "")
    return None


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
            only source, ``metrics.json``, is not a JSON object (truncated or edited); ``metrics.json`` names no
            method (not a run record); the message names the file.
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
    if metrics is not None and not metrics.get("method"):  # every run record names its method
        raise FileNotFoundError(f"{run / 'metrics.json'}: not a cxr-hfl run record (no method; truncated, edited "
                                "or another program's file?)")
    snap = _read(found[0]) if found else None
    if metrics is not None:
        state = "FINISHED:FAILED" if metrics.get("failed") else "FINISHED:COMPLETED"
        if snap is None:
            snap = {"phase": "failed" if metrics.get("failed") else "done", "method": metrics.get("method"),
                    "excluded": {s: ev[-1].get("reason") for s, ev in (metrics.get("excluded_sites") or {}).items()},
                    "gate": metrics.get("gate"), "failed": metrics.get("failed")}
        snap.setdefault("gate", metrics.get("gate"))
        sites = sorted(set(metrics.get("sites") or {}) | set(metrics.get("excluded_sites") or {})
                       | set(metrics.get("expected_sites") or []) | set(metrics.get("not_deployed") or {}))
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
    view = job_view(snap, job_state=state, sites=sites, job_id=run.name, record=metrics)
    view["source"] = str(found[0]) if found else str(run / "metrics.json")
    tb = sorted({str(p.parent.parent) for p in (run / "workspace").rglob("events.out.tfevents.*")}) \
        if (run / "workspace").is_dir() else []
    view["tensorboard"] = tb[0] if tb else None
    view["mlflow"] = (metrics or {}).get("mlflow")  # the MLflow store of a --tracking mlflow run (its URI)
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
    """The view of a POC / provisioned job through an open ``flare_api`` session (the caller's startup kit).

    A running job's snapshot comes from the server's ``show_stats``; a finished job's sites are its record's
    (:func:`finished_record`: the job's ``server_results.json``, downloaded), so each reads ``took part``,
    ``excluded`` (round, reason), ``not deployed`` (reason) or ``missing``, with its final metrics and decision.
    The expected sites are the job meta's (``hfl_components.flare.participation.expected_sites``)."""
    from hfl_components.flare.participation import expected_sites, unreachable

    meta = session.get_job_meta(job_id) or {}
    state = str(meta.get("status") or "UNKNOWN")
    snap, record = None, None
    if state.upper().startswith("RUNNING"):
        try:
            stats = session.show_stats(job_id, "server") or {}
            snap = (stats.get("server") or {}).get("cxr_hfl")
        except Exception:  # noqa: BLE001 - the job may be starting or ending
            snap = None
    elif state.upper().startswith("FINISHED"):
        record = finished_record(session, job_id)
    heard = heard_sites(session)  # a site silent for over twice the heartbeat interval is not connected
    live = None if heard is None else {s: age for s, age in heard.items() if s not in unreachable([s], heard)}
    view = job_view(snap, job_state=state, sites=expected_sites(meta) or None, connected=live, job_id=job_id,
                    record=record)
    view["submitter"] = meta.get("submitter_name")
    view["schedule"] = schedule_note(state)  # running, or queued / starting (two jobs at once: status says which)
    if state.upper().startswith("FINISHED") and record is None:
        view["record_unavailable"] = "the job's results could not be downloaded; the sites' parts are unknown"
    return view


def heard_sites(session) -> dict[str, float | None] | None:
    """{site: seconds since the server last heard from it (None: unknown)} of the sites the server lists as
    connected (NVFlare's ``check_status``); None when the server cannot be asked. A site that stopped stays
    listed until its heartbeat times out: ``participation.unreachable`` tells the live ones."""
    from hfl_components.flare.participation import heard_from_status

    try:
        from nvflare.fuel.flare_api.api_spec import TargetType

        info = session.check_status(TargetType.SERVER) or {}
    except Exception:  # noqa: BLE001 - the view still shows the job
        return None
    return heard_from_status(info, time.time())


def finished_record(session, job_id: str) -> dict | None:
    """A finished job's server record (``cxr_hfl_results/server_results.json``), downloaded through the session
    into the kit's download folder and removed again; None when it cannot be downloaded or holds none."""
    import shutil

    try:
        path = Path(session.download_job_result(job_id))
    except Exception:  # noqa: BLE001 - NVFlare raises many kinds; the view says the record is unavailable
        return None
    try:
        hits = sorted(path.rglob("cxr_hfl_results/server_results.json"))
        return _read(hits[-1]) if hits else None
    finally:
        shutil.rmtree(path, ignore_errors=True)


def describe_site(p: dict) -> str:
    """One line for a site's last heartbeat, e.g. ``fedavg_train r1 round 1 epoch 2/3 loss 0.512``; a task whose
    round number would mislead is worded by its ``step`` (:func:`step`), e.g. ``evaluate (final
    evaluation)``."""
    s = f"{p.get('task')} ({p['step']})" if p.get("step") else f"{p.get('task')} r{p.get('round')}"
    if p.get("stage"):
        s += f" {p['stage']}"
    if p.get("epochs"):
        s += f" epoch {p.get('epoch') or 0}/{p['epochs']}"
    if isinstance(p.get("loss"), (int, float)):
        s += f" loss {p['loss']:.3f}"
    return s


FINAL_STATES = ("took part", "excluded", "not deployed", "missing")  # a finished job's parts (site_truth)


def format_site(site: str, d: dict, heard: bool = True) -> str:
    """One site's line of the view: name, state, seconds since its last heartbeat (``heard``), task, round, stage,
    epoch and loss, its latest validation metric and, when excluded or not deployed, the reason; an answered site
    while the server works says so instead of a heartbeat age. A finished job's site (:func:`site_truth`) shows
    its part, final test metrics, gate or acceptance decision and every round it was left out of. The simulator's
    live console (:class:`nvflare_jobs.progress.LiveProgress`) prints the same line without the heartbeat age."""
    parts = [f"{site:<14}{d['state']:<14}"]
    if "exclusions" in d:  # a finished job's truth
        return "  ".join(parts + _truth_parts(d)).rstrip()
    if d.get("waiting_for_server"):
        parts.append("done with its task; the server is working")
    elif heard and d.get("heard_s_ago") is not None and d["state"] != "done":
        parts.append(f"heard {d['heard_s_ago']:.0f} s ago")
    if d.get("task"):
        parts.append(describe_site(d))
    val = d.get("val") or {}
    m = next((k for k in ("balanced_accuracy", "accuracy", "auc") if isinstance(val.get(k), (int, float))), None)
    if m:
        parts.append(f"val {m} {val[m]:.3f} ({val.get('step') or 'round ' + str(val.get('round'))})")
    if d.get("reason"):
        parts.append(f"{'not deployed' if d['state'] == 'not deployed' else 'excluded'}: {d['reason']}")
    return "  ".join(parts).rstrip()


def _truth_parts(d: dict) -> list[str]:
    """The words of a finished job's site (:func:`site_truth` fields of a view entry)."""
    parts = []
    t = d.get("test") or {}
    if t:
        parts.append("test " + ", ".join(f"{k.replace('balanced_accuracy', 'bal. acc.').replace('auc', 'AUC')} "
                                         f"{t[k]:.3f}" for k in TEST_KEYS if k in t))
    if d.get("decision"):
        parts.append(d["decision"])
    if d["state"] in ("not deployed", "missing", "excluded") and d.get("reason"):
        parts.append(d["reason"] if d["state"] != "excluded" else "")
    for e in d.get("exclusions") or []:
        parts.append(f"left out of round {e.get('round')} ({e.get('task')}): {e.get('reason')}")
    return [p for p in parts if p]


def describe_progress(sp: dict | None) -> str | None:
    """The server stage's progress (``server_progress`` of a snapshot, ``HFLController.report_progress``) in
    words, e.g. ``distillation (steps) step 120 of 300, 40 s so far, about 60 s left``; None without one."""
    if not isinstance(sp, dict) or sp.get("step") is None:
        return None
    text = f"{sp.get('stage')} step {sp['step']}" + (f" of {sp['total']}" if sp.get("total") else "")
    if isinstance(sp.get("elapsed_s"), (int, float)):
        text += f", {sp['elapsed_s']:.0f} s so far"
    if isinstance(sp.get("eta_s"), (int, float)):
        text += f", about {sp['eta_s']:.0f} s left"
    return text


QUEUED_STATES = ("SUBMITTED", "DISPATCHED")  # NVFlare's job states before the job runs


def schedule_note(job_state: str) -> str | None:
    """Whether a job runs or waits, in words: a job NVFlare has not started yet (``SUBMITTED``, ``DISPATCHED``) is
    queued until its sites are free and the server runs fewer jobs than its limit (several jobs can run at once
    when their sites allow); None for any other state."""
    st = str(job_state).upper()
    if st.startswith("SUBMITTED"):
        return "queued: NVFlare starts it when enough of its sites are connected and free"
    if st.startswith("DISPATCHED"):
        return "starting: being deployed to its sites"
    if st.startswith("RUNNING"):
        return "running"
    return None


def format_view(v: dict) -> str:
    """The view as console lines (``cxr-hfl status``, ``poc status``, and the simulator's console at the end)."""
    head = f"job {v.get('job_id')}: {v.get('job_state')}"
    if str(v.get("job_state")).upper().startswith(QUEUED_STATES):
        head += f" ({schedule_note(v['job_state'])})"
    if v.get("method"):
        head += f" ({v['method']})"
    if v.get("task"):
        where = v.get("step") or f"round {v.get('round')}"
        head += f"; {where} task {v['task']} ({v.get('phase')})"
    lines = [head]
    if describe_progress(v.get("server_progress")):
        lines.append(f"  server: {describe_progress(v['server_progress'])}")
    if v.get("record_unavailable"):
        lines.append(f"  {v['record_unavailable']}")
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
    if v.get("mlflow"):
        lines.append(f"  MLflow store: {v['mlflow']} (mlflow ui --backend-store-uri {v['mlflow']})")
    return "\n".join(lines)
