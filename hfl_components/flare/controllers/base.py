"""Base plumbing of the server-side workflows (NVFlare ``ModelController`` subclasses; one module per method in
this package: ``baselines`` (Local, FedAvg), ``ohfl``, ``fedsaf`` (FedSAF / FedProto), ``fedtopo``).

Each controller's ``run_method()`` tells the method's story round by round; the maths is delegated to the pure
functions in ``hfl_components`` (upload checks: ``hfl_components.upload_checks``). Common plumbing lives in
:class:`HFLController`:

* ``broadcast(task, params, meta)`` sends one task to every site, waits, and returns only the successful answers;
  a site that answers with an error, or whose upload fails validation, is logged by name and left out of that
  round (the federation continues while at least ``min_sites`` remain).
* how long it waits is decided by :class:`hfl_components.wait_policy.WaitPolicy` (``send_model_and_wait``): a site
  that is not running or has gone silent (no progress heartbeat) is dropped at once, a slow site that still
  heart-beats is kept, and once ``min_sites`` answered the rest get max(60 s, 3 x the slowest answer's compute
  seconds) or the fixed ``late_wait_s``;
* the server's state (phase, sites waited for, exclusions, each site's last progress) is rewritten to
  ``cxr_hfl_results/status.json`` for the live console (``nvflare_jobs.progress``);
* payload bytes up/down are counted per round (array bytes only);
* every result is written as JSON under ``<server run dir>/cxr_hfl_results/`` so the simulator, POC download and
  production all turn into the same ``metrics.json`` (``nvflare_jobs.results``).

Constructor arguments are stored under their own names (NVFlare's job export reads ``self.<arg>``, trap 3).
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
from nvflare.app_common.abstract.fl_model import FLModel
from nvflare.app_common.workflows.model_controller import ModelController

from chest_xray.labels import one_label_scheme
from hfl_components.flare.messages import payload_bytes
from hfl_components.flare.options import resolve, validate

RESULTS_DIR = "cxr_hfl_results"
PROGRESS_EVENT = "fed.analytix_log_stats"  # what ConvertToFedEvent makes of a site's flare.log(...)
STATS_EVENT = "info_collector.get_stats"  # nvflare.widgets.info_collector.InfoCollector.EVENT_TYPE_GET_STATS
STATS_COLLECTOR = "info_collector.stats_collector"  # InfoCollector.CTX_KEY_STATS_COLLECTOR
STATS_GROUP = "cxr_hfl"
PROGRESS_KEY = "cxr_hfl_progress"
POLL_S = 0.5


def jsonable(x):
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, (np.floating, float)):
        v = float(x)
        return v if np.isfinite(v) else None
    if isinstance(x, (np.integer,)):
        return int(x)
    return x


def _int_arg(method: str, name: str, value, minimum: int) -> int:
    """``value`` as an int >= ``minimum`` (a hand-edited job may hold "3" or 3.0); else ValueError naming the
    controller argument, e.g. ``ohfl: seed must be an integer, got 'a'`` or ``ohfl: late_wait_s must be at least 0,
    got -5``."""
    try:
        v = int(value)
        ok = not isinstance(value, bool) and float(value) == v
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{method}: {name} must be an integer, got {value!r}")
    if v < minimum:
        raise ValueError(f"{method}: {name} must be at least {minimum}, got {v}")
    return v


class HFLController(ModelController):
    """Base workflow: task broadcast with per-site error tolerance, byte accounting, results on disk.

    Args:
        num_rounds (int): rounds of training (methods with one-shot upload ignore it). Default 1.
        min_sites (int): fewest usable site answers for a round to proceed. Default 1.
        task_config (dict): method settings sent to every site in ``meta["task_config"]``. Default {}.
        task_timeout (int): seconds to wait for a task (0 = no limit). Default 0.
        late_wait_s (int | None): None (default) = adaptive wait: once ``min_sites`` sites have answered a task, the
            others get at most max(60 s, 3 x the slowest answering site's compute seconds), and a site still sending
            heartbeats is kept (``hfl_components.wait_policy``). A number fixes that late wait in seconds (dropping
            every site still missing when it runs out); 0 waits for every live site. Sites that are not running or
            have gone silent are dropped at once in every mode.
        seed (int): server-side seed (initial global models, random strategies). Default 0.
    """

    method = "base"

    @property
    def _always_serialize_args(self) -> tuple[str, ...]:
        """Every constructor argument of this controller class, for NVFlare's job writer.

        NVFlare's ``FedJobConfig._get_args`` leaves out an argument whose value equals the constructor's default, so an
        exported job would carry, e.g., no ``repair``/``probe_at`` at the defaults, and a server running an older
        ``cxr-hfl`` would silently apply *its* defaults. Names returned here are always written
        (``_always_serialize_args`` is NVFlare's hook), so the exported job states every setting it runs with."""
        import inspect

        return tuple(p for p in inspect.signature(type(self).__init__).parameters if p not in ("self", "args", "kwargs"))

    def __init__(self, num_rounds: int = 1, min_sites: int = 1, task_config: dict | None = None,
                 task_timeout: int = 0, seed: int = 0, late_wait_s: int | None = None, entry_ref: str | None = None):
        super().__init__(persistor_id="")
        # ``"module:function"`` returning this method's catalogue entry, given by the job builder
        # (``nvflare_jobs.jobs.make_controller``): the catalogue names the controllers, so they never import it
        self.entry_ref = entry_ref
        self.late_wait_s = None if late_wait_s is None else _int_arg(self.method, "late_wait_s", late_wait_s, 0)
        self.last_dropped: dict[str, str] = {}
        self.num_rounds = _int_arg(self.method, "num_rounds", num_rounds, 1)
        self.min_sites = _int_arg(self.method, "min_sites", min_sites, 1)
        if task_config is not None and not isinstance(task_config, dict):
            raise ValueError(f"{self.method}: task_config must be a mapping, got {type(task_config).__name__}")
        self.task_config = dict(task_config or {})
        self.task_timeout = _int_arg(self.method, "task_timeout", task_timeout, 0)
        self.seed = _int_arg(self.method, "seed", seed, 0)
        self.record = {"method": self.method, "task_config": self.task_config, "rounds": [], "excluded": {},
                       "bytes_uploaded": 0, "bytes_downloaded": 0, "server_seconds": {}, "sites": {}}
        self._heard: dict[str, float] = {}  # site -> monotonic time of its last progress heartbeat
        self._progress: dict[str, dict] = {}  # site -> last progress (task, epoch, loss) it reported
        self._down: set[str] = set()  # sites that did not answer the last task they were sent
        self._status = {"phase": "starting", "waiting_for": [], "task": None, "round": None}

    # ------------------------------------------------------------------ plumbing
    def results_dir(self) -> Path:
        d = Path(self.get_run_dir()) / RESULTS_DIR
        d.mkdir(parents=True, exist_ok=True)
        return d

    def handle_event(self, event_type: str, fl_ctx) -> None:
        """Progress heartbeats from the sites (``flare.log`` -> ``ConvertToFedEvent`` -> ``fed.analytix_log_stats``):
        remember when each site was last heard from and what it reported."""
        super().handle_event(event_type, fl_ctx)
        if event_type == STATS_EVENT:  # NVFlare's admin `show_stats` (flare_api Session.show_stats): `cxr-hfl status`
            collector = fl_ctx.get_prop(STATS_COLLECTOR, None)
            if collector is not None:
                collector.add_info(STATS_GROUP, jsonable(self.status_snapshot()))
            return
        if event_type != PROGRESS_EVENT:
            return
        try:
            from nvflare.apis.analytix import TrackConst
            from nvflare.apis.dxo import from_shareable
            from nvflare.apis.fl_constant import FLContextKey, ReservedKey

            data = fl_ctx.get_prop(FLContextKey.EVENT_DATA, None)
            site = data.get_peer_prop(ReservedKey.IDENTITY_NAME, None)
            body = from_shareable(data).data or {}
            if site is None or body.get(TrackConst.TRACK_KEY) != PROGRESS_KEY:
                return
            raw = body.get(TrackConst.TRACK_VALUE)
            self._heard[site] = time.monotonic()
            self._progress[site] = json.loads(raw) if isinstance(raw, str) else dict(raw)
        except Exception as e:  # noqa: BLE001 - a malformed heartbeat must not stop the server
            self.warning(f"ignored a malformed progress event: {type(e).__name__}: {e}")

    def set_phase(self, phase: str, **extra) -> None:
        """What the server is doing now (``waiting``, ``probing``, ``CKA``, ``OT``, ``averaging``, ``repair``...),
        for the live console (``status.json``) and the log. A new phase ends the previous stage's progress."""
        if phase != self._status.get("phase"):
            self._status["server_progress"] = None
        self._status.update({"phase": phase, **extra})
        if phase != "waiting":
            self._status["waiting_for"] = []
        self._write_status()

    def report_progress(self, stage: str, step: int, total: int | None) -> None:
        """Progress within a server stage (fusion: pairwise fusions done; distillation: optimiser steps), for
        ``status``: ``status.json``'s ``server_progress`` = ``{"stage", "step", "total", "elapsed_s", "eta_s"}``,
        the ETA (seconds) extrapolated from the stage's mean seconds per step so far (None before the first step
        or without a total). Rewrites ``status.json`` at most every :data:`POLL_S` seconds, and at the last step."""
        now = time.monotonic()
        prev = self._status.get("server_progress") or {}
        if prev.get("stage") != stage:
            self._stage_t0 = now
        elapsed = now - getattr(self, "_stage_t0", now)
        eta = elapsed / step * (total - step) if step > 0 and total else None
        self._status["server_progress"] = {"stage": stage, "step": int(step), "total": total,
                                           "elapsed_s": round(elapsed, 1),
                                           "eta_s": None if eta is None else round(max(0.0, eta), 1)}
        if now - getattr(self, "_progress_written", 0.0) >= POLL_S or step == total:
            self._progress_written = now
            self._write_status()

    def stage_log(self, stage: str):
        """A ``log`` callable for a server stage's loop: each line goes to the log (``info``) and a line naming
        ``step k/N`` (the distillation loop's, ``hfl_components.fusion.distill``) is reported as ``stage``'s
        progress (:meth:`report_progress`); a ``[group]`` prefix of the line is added to the stage's name."""
        import re

        pattern = re.compile(r"(?:\[(?P<group>[^\]]+)\].*?)?step (?P<k>\d+)/(?P<n>\d+)")

        def log(line: str) -> None:
            self.info(line)
            m = pattern.search(str(line))
            if m:
                name = f"{stage} [{m['group']}]" if m["group"] else stage
                self.report_progress(name, int(m["k"]), int(m["n"]))
        return log

    def note_participation(self, fl_ctx) -> None:
        """At job start: the job's expected sites (its meta, ``hfl_components.flare.participation``) against the
        sites NVFlare deployed it to; every expected site the job did not reach goes to ``record["not_deployed"]``
        ({site: reason}) and the log, the expected sites to ``record["expected_sites"]``."""
        from nvflare.apis.fl_constant import FLContextKey

        from hfl_components.flare.participation import expected_sites, not_deployed

        meta = fl_ctx.get_prop(FLContextKey.JOB_META, None) or {}
        try:
            deployed = sorted(c.name for c in self.engine.get_clients())
        except Exception:  # noqa: BLE001 - outside a running job (unit tests)
            return
        expected = expected_sites(meta) or deployed
        missing = not_deployed(expected, deployed, meta.get("min_clients"))
        self.record["expected_sites"] = expected
        self.record["not_deployed"] = missing
        for site, why in missing.items():
            self.warning(f"site {site} is not part of this job: {why}")
        self._write_status()

    def status_snapshot(self) -> dict:
        """The server's live state (``status.json``, and NVFlare's ``show_stats`` under ``cxr_hfl``): phase, task,
        round, the sites waited for / answered / excluded (with the reason), each site's last heartbeat (task,
        round, epoch, loss, seconds since), each site's latest validation metrics, once decided the gate, the
        expected sites and those the job never reached (``not_deployed``), and the server stage's progress."""
        now = time.monotonic()
        latest_val: dict[str, dict] = {}
        for r in self.record["rounds"]:
            for s, m in (r.get("sites") or {}).items():
                if isinstance((m or {}).get("val"), dict):
                    latest_val[s] = {"round": r.get("round"), **{k: v for k, v in m["val"].items()
                                                                  if isinstance(v, (int, float))}}
        return dict(self._status, time=time.time(), method=self.method, num_rounds=self.num_rounds,
                    sites={s: dict(p, heard_s_ago=round(now - self._heard[s], 1)) for s, p in self._progress.items()},
                    excluded={s: ev[-1]["reason"] for s, ev in self.record["excluded"].items()},
                    down=sorted(self._down), latest_val=latest_val, gate=self.record.get("gate"),
                    failed=self.record.get("failed"), expected_sites=self.record.get("expected_sites"),
                    not_deployed=self.record.get("not_deployed") or {},
                    final=self.final_summary() if self._status.get("phase") in ("done", "failed") else None)

    def final_summary(self) -> dict:
        """What a finished job's status needs of the record (``nvflare_jobs.status.site_truth``): per site its
        final test metrics, gate and acceptance outcome; every exclusion (round, task, reason); the expected sites
        and those never deployed to."""
        keep = ("accuracy", "balanced_accuracy", "auc")
        sites = {}
        for s, b in self.record["sites"].items():
            test = b.get("test") if isinstance(b.get("test"), dict) else {}
            gate = b.get("gate") if isinstance(b.get("gate"), dict) else None
            acc = b.get("acceptance") if isinstance(b.get("acceptance"), dict) else None
            sites[s] = {"test": {k: test[k] for k in keep if k in test},
                        "gate": None if gate is None else {k: gate.get(k) for k in ("adopted", "reason")},
                        "acceptance": None if acc is None else {"outcome": acc.get("outcome")}}
        return {"method": self.method, "sites": sites, "excluded": self.record["excluded"],
                "expected_sites": self.record.get("expected_sites"),
                "not_deployed": self.record.get("not_deployed") or {},
                **({"cross_site": self.record["cross_site"]} if "cross_site" in self.record else {})}

    def _write_status(self) -> None:
        try:
            d = self.results_dir()
        except Exception:  # noqa: BLE001 - outside a running job (unit tests)
            return
        st = self.status_snapshot()
        tmp = d / "status.json.tmp"
        tmp.write_text(json.dumps(jsonable(st)))
        tmp.replace(d / "status.json")

    def send_model_and_wait(self, task_name: str = "train", data: FLModel = None, targets=None,
                            min_responses: int = None, timeout: int = 0) -> list:
        """Send a task to every site and wait as :class:`hfl_components.wait_policy.WaitPolicy` says: a site that is
        not running or has gone silent is dropped at once, a slow site that still heart-beats is kept, and once
        ``min_responses`` sites answered the rest get an adaptive (or the fixed ``late_wait_s``) late wait.
        Dropped sites are in ``self.last_dropped`` ({site: reason}); answers that arrive after are ignored."""
        from hfl_components.wait_policy import SiteView, WaitPolicy

        clients = list(targets) if targets else [c.name for c in self.engine.get_clients()]
        late = None if self.late_wait_s is None else (float("inf") if self.late_wait_s == 0 else self.late_wait_s)
        policy = WaitPolicy(min_sites=max(1, min(int(min_responses or len(clients)), len(clients))), late_wait_s=late)
        results, answered, lock = [], {}, threading.Lock()

        def on_result(model: FLModel):
            with lock:
                site = (model.meta or {}).get("client_name", "?")
                results.append(model)
                answered[site] = (time.monotonic(), (model.meta or {}).get("compute_s"))
            try:
                self.on_site_result(task_name, model)
            except Exception as e:  # noqa: BLE001 - an early-start hook must never lose a site's answer
                self.warning(f"task {task_name}: on_site_result failed for {site}: {type(e).__name__}: {e}")

        self.set_fl_context(data)
        self._current_min_responses = len(clients)
        self._current_num_targets = len(clients)
        self._current_failed_clients = set()
        task = self._prepare_task(data=data, task_name=task_name, timeout=timeout, callback=on_result)
        start, wall0 = time.monotonic(), time.time()
        # NVFlare's non-blocking Controller.broadcast (our own broadcast() is the per-round helper below)
        super().broadcast(task=task, fl_ctx=self.fl_ctx, targets=clients, min_responses=0)
        decision = None
        while True:
            finished = task.completion_status is not None
            with lock:
                views = {}
                for s in clients:
                    ct = task.last_client_task_map.get(s)
                    sent = getattr(ct, "task_sent_time", None) if ct is not None else None
                    ans = answered.get(s)
                    heard = self._heard.get(s)
                    fetched = None if sent is None else start + max(0.0, sent - wall0)
                    views[s] = SiteView(fetched_at=fetched, answered_at=ans[0] if ans else None,
                                        compute_s=ans[1] if ans else None,
                                        last_heard=heard if heard is not None and heard >= start else
                                        (fetched if heard is not None else None))
            decision = policy.decide(time.monotonic(), start, views, down_before=self._down)
            new = sorted(set(decision.dropped) - set(self._status.get("dropped_now", {})))
            for s in new:
                self.warning(f"task {task_name}: site {s} excluded: {decision.dropped[s]}")
            self._status.update({"phase": "waiting", "task": task_name, "waiting_for": decision.waiting,
                                 "answered": sorted(answered), "dropped_now": dict(decision.dropped),
                                 "late_wait_ends_in_s": None if decision.deadline is None else
                                 round(decision.deadline - time.monotonic(), 1)})
            self._write_status()
            if finished or decision.done or self.abort_signal.triggered:
                break
            time.sleep(POLL_S)
        if task.completion_status is None:
            self.cancel_task(task)
        with lock:
            out = list(results)
        got = {(r.meta or {}).get("client_name") for r in out}
        self.last_dropped = {s: r for s, r in decision.dropped.items() if s not in got}
        for s in clients:
            if s not in got and s not in self.last_dropped:
                self.last_dropped[s] = "no answer before the task ended (timeout or abort)"
        self._down = set(self.last_dropped)
        self._status.update({"dropped_now": {}, "waiting_for": []})
        return out

    def on_site_result(self, task_name: str, model: FLModel) -> None:
        """Called as each site's answer to ``task_name`` arrives, while the others still work (NVFlare's result
        thread; the answer is not yet validated). A method may start work that needs only this answer here (OHFL
        prepares its probe at the site's input size); it must be cheap and thread-safe. Default: nothing."""

    # opts key -> attribute name where a controller keeps an option under another name; options that are neither
    # an attribute nor in task_config read as missing (their catalogue default)
    OPTION_ATTRS: dict[str, str] = {}
    TASK_CONFIG_KEYS: dict[str, str] = {}  # opts key -> task_config key where they differ (lam -> lambda)

    def current_options(self) -> dict:
        """The method's options as this controller holds them (its constructor arguments, as an exported job's
        ``config_fed_server.json`` sets them, and its ``task_config``), keyed as in the catalogue."""
        e = self.method_entry()
        own = vars(self)
        out = {}
        for o in (e.options if e is not None else ()):
            attr = self.OPTION_ATTRS.get(o.key, o.key)
            tck = self.TASK_CONFIG_KEYS.get(o.key, o.key)
            if attr in own:
                out[o.key] = own[attr]
            elif tck in self.task_config:
                out[o.key] = self.task_config[tck]
        return out

    def check_options(self) -> dict:
        """Check this controller's options with ``catalogue.validate_options`` (the same function
        ``make_controller`` runs), so that an exported job whose config was edited fails when it starts, naming
        the option, before any site trains. Raises ValueError (``catalogue.OptionError`` for a bad option; an
        unknown method)."""
        for key in ("num_rounds", "min_sites"):  # common arguments an edited job may break too
            if getattr(self, key) < 1:
                raise ValueError(f"{self.method}: {key} must be at least 1, got {getattr(self, key)}")
        e = self.method_entry()
        if e is None:
            raise ValueError(f"unknown method {self.method!r}: the job names no catalogue entry (entry_ref)")
        return validate(e, self.current_options())

    def method_entry(self):
        """This method's catalogue entry (through ``entry_ref``), or None for a controller built without one."""
        return resolve(self.entry_ref)(self.method) if self.entry_ref else None

    def use_checked_options(self, checked: dict) -> None:
        """Put the typed values of ``check_options`` into ``task_config``, which the sites read: an edited job's
        ``"gate": "no"`` passes the check as False, and a site must not read the string (truthy) instead. Every
        option the controller does not hold as an attribute is sent, the catalogue default where the job lacks it
        (a job exported before the option existed), so site handlers read complete, typed options and keep no
        defaults of their own."""
        for key, val in checked.items():
            tck = self.TASK_CONFIG_KEYS.get(key, key)
            if self.OPTION_ATTRS.get(key, key) not in vars(self):
                self.task_config[tck] = val

    def start_controller(self, fl_ctx) -> None:
        """NVFlare's start hook (server side, before ``run()`` sends any task): also checks the options."""
        super().start_controller(fl_ctx)
        self.note_participation(fl_ctx)
        try:
            self.use_checked_options(self.check_options())
            self.check_server_inputs()
        except (ValueError, FileNotFoundError) as e:
            self.record["failed"] = f"invalid job configuration: {e}"
            self.error(f"refusing to start: invalid job configuration: {e}")
            self.set_phase("failed", error=self.record["failed"])
            self.save_record()
            raise

    def check_server_inputs(self) -> None:
        """Check, on the server at job start (before any site is sent a task), the files the method reads on the
        server (OHFL: its probe set). Raises ValueError / FileNotFoundError naming the file. Default: nothing."""

    @classmethod
    def from_options(cls, method: str, profile: dict[str, dict], opts: dict, common: dict, task_config: dict):
        """Build the controller of ``method`` for a profile ({site: config with ``model``}) from the method's
        options already checked by ``catalogue.validate_options`` (``opts``), the common arguments (``num_rounds``,
        ``min_sites``, ``task_timeout``, ``seed``, ``late_wait_s``) and the site ``task_config`` (epochs).
        Subclasses with their own arguments override it. Raises ValueError for a profile the method cannot run."""
        return cls(task_config=task_config, **common)

    def upload_context(self) -> dict:
        """What the upload checks (``hfl_components.upload_checks``) compare a site's upload with."""
        return {"num_classes": getattr(self, "num_classes", None), "feature_dim": getattr(self, "feature_dim", None),
                "expected_shapes": getattr(self, "_expected", None)}

    def validate_result(self, task: str, result: FLModel) -> None:
        """Run the method's upload check for ``task`` (catalogue ``upload_checks``; pure functions in
        ``hfl_components.upload_checks``); raises ValueError to reject a site's upload for this task."""
        e = self.method_entry()
        path = e.upload_checks.get(task) if e is not None else None
        if path:
            resolve(path)(result.params or {}, result.meta or {}, self.upload_context())

    def check_label_schemes(self, results: list) -> None:
        """Refuse a federation whose sites declare different label schemes (``meta["labels"]`` of their answers,
        this round and earlier ones); the scheme goes to ``record["labels"]``. Raises ``LabelSchemeMismatch``
        (a ValueError) naming the sites of each scheme."""
        seen = self.record.setdefault("site_labels", {})
        for r in results:
            m = r.meta or {}
            if m.get("status") == "ok" and m.get("labels") is not None:
                seen.setdefault(m.get("client_name", "?"), m["labels"])
        try:
            self.record["labels"] = one_label_scheme(seen)
        except ValueError as e:
            self.error(f"refusing the federation: {e}")
            raise

    def broadcast(self, task: str, rnd: int, params: dict | None = None, meta: dict | None = None) -> dict:
        """Send ``task`` to all sites; return {site: FLModel} of the usable answers (sorted by site)."""
        meta = dict(meta or {})
        meta["task_config"] = self.task_config
        meta["round"] = rnd
        meta.setdefault("method", self.method)
        params = params or {}
        t0 = time.perf_counter()
        data = FLModel(params=params, meta=meta, current_round=rnd, total_rounds=self.num_rounds)
        self.last_dropped = {}
        self._status["round"] = rnd
        results = self.send_model_and_wait(task_name=task, data=data, timeout=self.task_timeout,
                                           min_responses=self.min_sites)
        self.check_label_schemes(results)
        good, errors, up, up_site = {}, {}, 0, {}
        for r in results:
            site = (r.meta or {}).get("client_name", "?")
            up_site[site] = payload_bytes(r.params)
            up += up_site[site]
            if (r.meta or {}).get("status") != "ok":
                errors[site] = (r.meta or {}).get("error", "no status in answer")
            else:
                try:
                    self.validate_result(task, r)
                    good[site] = r
                except ValueError as e:
                    errors[site] = f"upload rejected: {e}"
        try:
            expected = {c.name for c in self.engine.get_clients()}
        except Exception:  # noqa: BLE001 - outside a running job (unit tests)
            expected = set()
        answered = {(r.meta or {}).get("client_name") for r in results}
        for site in sorted(expected - answered):
            errors[site] = getattr(self, "last_dropped", {}).get(site, "no answer in time (late or down)")
        for site, reason in sorted(errors.items()):
            self.warning(f"round {rnd} task {task}: site {site} left out: {reason}")
            self.record["excluded"].setdefault(site, []).append({"round": rnd, "task": task, "reason": reason})
        down = payload_bytes(params) * len(results)
        self.record["bytes_uploaded"] += up
        self.record["bytes_downloaded"] += down
        self.record["rounds"].append({
            "round": rnd, "task": task, "seconds": time.perf_counter() - t0, "bytes_up": up, "bytes_down": down,
            "site_compute_s": {s: (r.meta or {}).get("compute_s") for s, r in sorted(good.items())},
            "bytes_up_per_site": dict(sorted(up_site.items())), "bytes_down_per_site": payload_bytes(params),
            "sites": {s: jsonable(r.metrics or {}) for s, r in sorted(good.items())}, "errors": errors})
        self._write_status()
        if len(good) < self.min_sites:
            self.record["failed"] = (f"round {rnd} task {task}: only {len(good)} usable site answers "
                                     f"(min_sites={self.min_sites})")
            raise RuntimeError(f"round {rnd} task {task}: only {len(good)} usable site answers "
                               f"(min_sites={self.min_sites}); errors: {errors}")
        self.info(f"round {rnd} task {task}: {len(good)} sites ok, {len(errors)} left out, "
                  f"{up} bytes up, {down} bytes down")
        return dict(sorted(good.items()))

    def final_evaluation(self, rnd: int, params: dict | None = None, meta: dict | None = None) -> None:
        """Every site evaluates the model it deploys on its own test split; results go to record['sites']."""
        res = self.broadcast("evaluate", rnd, params, meta)
        for site, r in res.items():
            m = r.metrics or {}
            self.record["sites"].setdefault(site, {}).update({
                "model": (r.meta or {}).get("spec"), "input_size": (r.meta or {}).get("input_size"),
                "n_train": (r.meta or {}).get("n_train"), "n_test": (m.get("test") or {}).get("n"),
                "test": jsonable(m.get("test")), "val": jsonable(m.get("val"))})
            if m.get("deploy") is not None:  # deploy: best_val -> {rule, round, score} of the deployed round
                self.record["sites"][site]["deploy"] = jsonable(m["deploy"])
            if m.get("operating_point") is not None:  # OHFL: the site's own sensitivity at the federated threshold
                self.record["sites"][site]["operating_point"] = jsonable(m["operating_point"])

    def save_global_model(self, spec: dict, numpy_state: dict) -> Path:
        """Write ``<results dir>/global_model.pt`` (``hfl_components.models.save_model_file``: weights, spec, the
        sites' label scheme, method and seed)."""
        from hfl_components.models import save_model_file

        return save_model_file(self.results_dir() / "global_model.pt", spec, numpy_state,
                               labels=self.record.get("labels"), kind="global",
                               provenance={"method": self.method, "seed": self.seed})

    def save_record(self) -> None:
        p = self.results_dir() / "server_results.json"
        p.write_text(json.dumps(jsonable(self.record), indent=1))
        self.info(f"results written to {p}")

    def run(self) -> None:
        t0 = time.perf_counter()
        try:
            self.run_method()
            self.set_phase("done")
        except Exception as e:
            self.record.setdefault("failed", f"{type(e).__name__}: {e}")
            self.set_phase("failed", error=self.record["failed"])
            raise
        finally:
            self.record["server_seconds"]["total"] = time.perf_counter() - t0
            self.save_record()

    def run_method(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


def payload_round(record: dict, rnd: int, up_theory: int, down_theory: int) -> dict:
    """Per-site payload of the last broadcast (bytes of float32 arrays) against the theory; appended to
    ``record["payload"]["per_round"]``."""
    r = record["rounds"][-1]
    row = {"round": rnd, "up_per_site": dict(r.get("bytes_up_per_site", {})),
           "down_per_site": int(r.get("bytes_down_per_site", 0)), "theory_up_per_site": int(up_theory),
           "theory_down_per_site": int(down_theory)}
    ok_sites = [s for s in row["up_per_site"] if s not in r.get("errors", {})]
    row["matches_theory"] = (row["down_per_site"] == down_theory
                             and all(row["up_per_site"][s] == up_theory for s in ok_sites))
    record["payload"]["per_round"].append(row)
    return row
