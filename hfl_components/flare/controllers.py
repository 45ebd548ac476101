"""Server-side workflows (NVFlare ``ModelController`` subclasses), one per method.

Each controller's ``run()`` tells the method's story round by round; the maths is delegated to the pure
functions in ``hfl_components``. Common plumbing lives in :class:`HFLController`:

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
from hfl_components.flare.site_tasks import GLOBAL_PREFIX, payload_bytes

RESULTS_DIR = "cxr_hfl_results"
PROGRESS_EVENT = "fed.analytix_log_stats"  # what ConvertToFedEvent makes of a site's flare.log(...)
PROGRESS_KEY = "cxr_hfl_progress"
POLL_S = 0.5


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, (np.floating, float)):
        v = float(x)
        return v if np.isfinite(v) else None
    if isinstance(x, (np.integer,)):
        return int(x)
    return x


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

    def __init__(self, num_rounds: int = 1, min_sites: int = 1, task_config: dict | None = None,
                 task_timeout: int = 0, seed: int = 0, late_wait_s: int | None = None):
        super().__init__(persistor_id="")
        self.late_wait_s = None if late_wait_s is None or int(late_wait_s) < 0 else int(late_wait_s)
        self.last_dropped: dict[str, str] = {}
        self.num_rounds = int(num_rounds)
        self.min_sites = int(min_sites)
        self.task_config = dict(task_config or {})
        self.task_timeout = int(task_timeout)
        self.seed = int(seed)
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
        for the live console (``status.json``) and the log."""
        self._status.update({"phase": phase, **extra})
        if phase != "waiting":
            self._status["waiting_for"] = []
        self._write_status()

    def _write_status(self) -> None:
        try:
            d = self.results_dir()
        except Exception:  # noqa: BLE001 - outside a running job (unit tests)
            return
        now = time.monotonic()
        st = dict(self._status, time=time.time(),
                  sites={s: dict(p, heard_s_ago=round(now - self._heard[s], 1)) for s, p in self._progress.items()},
                  excluded={s: ev[-1]["reason"] for s, ev in self.record["excluded"].items()},
                  down=sorted(self._down))
        tmp = d / "status.json.tmp"
        tmp.write_text(json.dumps(_jsonable(st)))
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

    # opts key -> attribute name where a controller keeps an option under another name; options that are neither
    # an attribute nor in task_config read as missing (their catalogue default)
    OPTION_ATTRS: dict[str, str] = {}
    TASK_CONFIG_KEYS: dict[str, str] = {}  # opts key -> task_config key where they differ (lam -> lambda)

    def current_options(self) -> dict:
        """The method's options as this controller holds them (its constructor arguments, as an exported job's
        ``config_fed_server.json`` sets them, and its ``task_config``), keyed as in the catalogue."""
        from hfl_components.flare.catalogue import CATALOGUE

        e = CATALOGUE.get(self.method)
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
        from hfl_components.flare.catalogue import validate_options

        return validate_options(self.method, self.current_options())

    def start_controller(self, fl_ctx) -> None:
        """NVFlare's start hook (server side, before ``run()`` sends any task): also checks the options."""
        super().start_controller(fl_ctx)
        try:
            self.check_options()
        except ValueError as e:
            self.record["failed"] = f"invalid job configuration: {e}"
            self.error(f"refusing to start: invalid job configuration: {e}")
            self.set_phase("failed", error=self.record["failed"])
            self.save_record()
            raise

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
        from hfl_components.flare.catalogue import CATALOGUE, resolve

        e = CATALOGUE.get(self.method)
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
            "sites": {s: _jsonable(r.metrics or {}) for s, r in sorted(good.items())}, "errors": errors})
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
                "test": _jsonable(m.get("test")), "val": _jsonable(m.get("val"))})

    def save_global_model(self, spec: dict, numpy_state: dict) -> Path:
        """Write ``<results dir>/global_model.pt`` (``hfl_components.models.save_model_file``: weights, spec, the
        sites' label scheme, method and seed)."""
        from hfl_components.models import save_model_file

        return save_model_file(self.results_dir() / "global_model.pt", spec, numpy_state,
                               labels=self.record.get("labels"), kind="global",
                               provenance={"method": self.method, "seed": self.seed})

    def save_record(self) -> None:
        p = self.results_dir() / "server_results.json"
        p.write_text(json.dumps(_jsonable(self.record), indent=1))
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


# ============================================================================ Local
class LocalController(HFLController):
    """Local baseline: each site trains its own model alone for ``num_rounds`` x local epochs; nothing is
    aggregated, only metrics travel."""

    method = "local"

    def run_method(self):
        for rnd in range(self.num_rounds):
            self.broadcast("local_train", rnd)
        self.final_evaluation(self.num_rounds)


# ============================================================================ FedAvg
class FedAvgController(HFLController):
    """FedAvg (McMahan et al., 2017) with every site forced onto one architecture, as OHFL's baseline (Sec. 4.3):
    the deepest spec in the profile. Sample-weighted averaging by ``meta["NUM_STEPS_CURRENT_ROUND"]`` (the
    sites' training sample counts).

    Args:
        global_spec (dict): the architecture every site trains.
        (others as :class:`HFLController`)
    """

    method = "fedavg"

    def __init__(self, global_spec: dict, num_rounds: int = 1, min_sites: int = 1, task_config: dict | None = None,
                 task_timeout: int = 0, seed: int = 0, late_wait_s: int | None = None):
        super().__init__(num_rounds, min_sites, task_config, task_timeout, seed, late_wait_s)
        self.global_spec = dict(global_spec)

    @classmethod
    def from_options(cls, method, profile, opts, common, task_config):
        from hfl_components.models import deepest_spec

        return cls(global_spec=deepest_spec(profile), task_config=task_config, **common)

    def run_method(self):
        import torch

        from hfl_components.aggregation import weighted_average
        from hfl_components.flare.site_tasks import to_numpy_state
        from hfl_components.models import build_model

        self.info(f"FedAvg: every site trains the deepest architecture in the profile: {self.global_spec}")
        torch.manual_seed(self.seed)
        weights = to_numpy_state(build_model(self.global_spec).state_dict())
        self._expected = {k: v.shape for k, v in weights.items()}
        meta = {"global_spec": self.global_spec}
        for rnd in range(self.num_rounds):
            res = self.broadcast("fedavg_train", rnd, {GLOBAL_PREFIX + k: v for k, v in weights.items()}, meta)
            self.set_phase("averaging", round=rnd)
            t0 = time.perf_counter()
            weights = weighted_average([r.params for r in res.values()],
                                       [float(r.meta["NUM_STEPS_CURRENT_ROUND"]) for r in res.values()])
            self.record["server_seconds"].setdefault("aggregation", 0.0)
            self.record["server_seconds"]["aggregation"] += time.perf_counter() - t0
        self.record["global_spec"] = self.global_spec
        self.final_evaluation(self.num_rounds, {GLOBAL_PREFIX + k: v for k, v in weights.items()}, meta)
        self.save_global_model(self.global_spec, weights)


# ============================================================================ OHFL
class OHFLController(HFLController):
    """OHFL (paper 003): one-shot upload of depth/width-varying site models, cross-layer OT fusion on the server
    (CKA layer alignment Sec. 3.1, identity balancing Sec. 3.2, OT neuron alignment Sec. 3.3-3.4, multi-model
    aggregation Sec. 3.5 / Algorithm 1), then each site fine-tunes the global model.

    Args:
        strategy (str): ``cid`` | ``cdd`` | ``cia`` | ``rand``. Default ``cid``.
        alignment (str): ``cka`` | ``random``. Default ``cka``.
        ot_solver (str): ``emd`` | ``sinkhorn``. Default ``emd``.
        ground_metric (str): ``wts`` (the paper) | ``acts``. Default ``wts``: ``acts`` wins the fusion ladder's
            two-model rungs but loses rung f, the main job's six-site fusion (``benchmarks/results/fusion_ladder.md``).
        probe (str): folder of public images for CKA, or ``generated`` (logged warning). Required.
        probe_size (int): number of probe images. Default 64.
        weighting (str): ``samples`` (cumulative sample counts) | ``half``. Default ``samples``.
        repair (str): ``none`` (the paper) | ``layer`` (one scale per fused hidden layer) | ``channel`` (REPAIR:
            every neuron's mean and std through the OT plan); ``hfl_components.fusion.repair``. True/False are read
            as ``layer``/``none``. Default ``layer``.
        cka (str): ``linear`` (the paper's Eq. 1) | ``debiased`` | ``pooled``. Default ``linear``.
        probe_at (str): ``largest`` (every model probed at the largest site input size) | ``own`` (each model at
            its own input size, the same images; fused models at their target's size). Default ``largest``.

        fusion_device (str): where the server runs the probe forward passes of fusion (CKA, repair):
            ``auto`` (CUDA when present) | ``cpu`` | ``cuda`` | ``cuda:N``. Default ``auto``.

    Site-side options travel in ``task_config``: ``init`` (``site`` | ``shared``: every site starts from the
    job seed's nested initialisation, ``hfl_components.models.fusable.shared_init_state``) and ``gate`` (a site
    deploys the fine-tuned global model only if it beats the site's own local model on its validation split). The
    gate's outcome per site is recorded under ``record["gate"]``.
    """

    method = "ohfl"

    def __init__(self, probe: str, strategy: str = "cid", alignment: str = "cka", ot_solver: str = "emd",
                 ground_metric: str = "wts", probe_size: int = 64, weighting: str = "samples",
                 repair: str | bool = "layer", num_rounds: int = 1, min_sites: int = 1, task_config: dict | None = None,
                 task_timeout: int = 0, seed: int = 0, late_wait_s: int | None = None, cka: str = "linear",
                 probe_at: str = "largest", fusion_device: str = "auto"):
        super().__init__(num_rounds, min_sites, task_config, task_timeout, seed, late_wait_s)
        from hfl_components.training.device import check_device_name

        self.fusion_device = check_device_name(fusion_device)
        self.probe = probe
        self.strategy = strategy
        self.alignment = alignment
        self.ot_solver = ot_solver
        self.ground_metric = ground_metric
        self.probe_size = int(probe_size)
        self.weighting = weighting
        from hfl_components.fusion.pairwise import repair_mode

        self.repair = repair_mode(repair)
        self.cka = cka
        if probe_at not in ("largest", "own"):
            raise ValueError(f"probe_at must be 'largest' or 'own', got {probe_at!r}")
        self.probe_at = probe_at

    OPTION_ATTRS = {"ot": "ot_solver", "server_device": "fusion_device"}

    @classmethod
    def from_options(cls, method, profile, opts, common, task_config):
        from hfl_components.models import is_fusable

        for site, cfg in profile.items():
            if not is_fusable(cfg["model"]):
                raise ValueError(f"OHFL needs fusable cnn/vgg11 models; site {site} has {cfg['model']}")
        common = {**common, "num_rounds": 1}
        return cls(probe=str(opts["probe"]), strategy=opts["strategy"], alignment=opts["alignment"],
                   ot_solver=opts["ot"], ground_metric=opts["ground_metric"], probe_size=int(opts["probe_size"]),
                   weighting=opts["weighting"], repair=opts["repair"], cka=opts["cka"], probe_at=opts["probe_at"],
                   fusion_device=opts["server_device"] or "auto",
                   task_config={**task_config, "init": opts["init"], "init_seed": common["seed"],
                                "gate": bool(opts["gate"])}, **common)

    def run_method(self):
        from hfl_components.flare.site_tasks import from_numpy_state, to_numpy_state
        from hfl_components.flare.probe import load_probe
        from hfl_components.fusion import aggregate_models

        uploads = self.broadcast("ohfl_train", 0)
        models = []
        for site, r in uploads.items():
            self.record["sites"].setdefault(site, {})["local"] = _jsonable((r.metrics or {}).get("local"))
            models.append({"name": site, "spec": r.meta["spec"], "state_dict": from_numpy_state(r.params),
                           "n_samples": int(r.meta["n_train"]), "val_acc": float(r.meta.get("val_acc", 0.0)),
                           "input_size": int(r.meta.get("input_size", 64))})
        sizes = sorted({m["input_size"] for m in models})
        self.set_phase("probing")
        t0 = time.perf_counter()
        in_ch = int(models[0]["spec"].get("in_channels", 1))
        names: list = []
        probe = {sz: load_probe(self.probe, sz, self.probe_size, in_channels=in_ch, seed=self.seed,
                                warn=self.warning if sz == sizes[-1] else None, files_out=names if sz == sizes[-1] else None)
                 for sz in (sizes if self.probe_at == "own" else sizes[-1:])}
        if self.probe_at == "largest":
            probe = probe[sizes[-1]]
        self.record["server_seconds"]["probe"] = time.perf_counter() - t0
        self.record["probe"] = {"source": str(self.probe), "n": len(names) if names else self.probe_size,
                                "sizes": sizes if self.probe_at == "own" else sizes[-1:], "files": names}
        shape = {k: tuple(v.shape) for k, v in probe.items()} if isinstance(probe, dict) else tuple(probe.shape)
        self.info(f"OHFL: fusing {len(models)} site models with strategy {self.strategy}, alignment "
                  f"{self.alignment} ({self.cka} CKA), OT {self.ot_solver}/{self.ground_metric}, repair {self.repair}, "
                  f"probe {shape}")
        from hfl_components.training.device import describe_device, resolve_device

        device = resolve_device(self.fusion_device)
        self.record["fusion_device"] = describe_device(device)
        self.info(f"OHFL: fusion probe passes on {self.record['fusion_device']}")
        self.set_phase("fusing (CKA layer alignment, OT neuron alignment, averaging, repair)")
        t0 = time.perf_counter()
        spec, state, record = aggregate_models(models, strategy=self.strategy, probe=probe,
                                               alignment=self.alignment, ot_solver=self.ot_solver,
                                               ground_metric=self.ground_metric, weighting=self.weighting,
                                               seed=self.seed, repair=self.repair, cka=self.cka, device=device)
        self.record["server_seconds"]["fusion_total"] = time.perf_counter() - t0
        self.record["server_fusion_s"] = _jsonable(record.get("phase_seconds", {}))
        self.record["global_spec"] = spec
        (self.results_dir() / "alignment_record.json").write_text(json.dumps(_jsonable(record), indent=1))
        weights = to_numpy_state(state)
        self.save_global_model(spec, weights)
        meta = {"global_spec": spec}
        ft = self.broadcast("ohfl_finetune", 1, {GLOBAL_PREFIX + k: v for k, v in weights.items()}, meta)
        gate = {}
        for site, r in ft.items():
            m = r.metrics or {}
            self.record["sites"].setdefault(site, {}).update({
                "global_zero_shot": _jsonable(m.get("global_zero_shot")),
                "finetune_loss": _jsonable(m.get("finetune_loss")),
                "gate": _jsonable(m.get("gate"))})
            if m.get("gate") is not None:
                gate[site] = m["gate"]
        if gate:
            adopted = sorted(s for s, g in gate.items() if g.get("adopted"))
            self.record["gate"] = {"adopted": len(adopted), "sites": len(gate), "adopted_sites": adopted,
                                   "kept_local": sorted(set(gate) - set(adopted))}
            self.info(f"deployment gate: {len(adopted)} of {len(gate)} sites adopted the federated model"
                      + (f"; kept their local model: {', '.join(self.record['gate']['kept_local'])}"
                         if len(adopted) < len(gate) else ""))
        self.final_evaluation(2)


# ============================================================================ FedSAF / FedProto
def _payload_round(record: dict, rnd: int, up_theory: int, down_theory: int) -> dict:
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


class FedSAFController(HFLController):
    """FedSAF (paper 000, Sec. III): sites keep heterogeneous models and exchange only class prototypes (C x d)
    and counts; the server builds global prototypes (FedProto weighted mean Eq. 3, fixed hypersphere Eq. 4, or
    trainable FedTGP-style Eq. 5) and logs their effective dimensionality (Fig. 1) every round.

    Round 0 broadcasts nothing (supervised-only local training, issue 5 -- also for ``fixed`` prototypes, so every
    construction starts from the same supervised round); from round 1 the server sends ``global_prototypes``
    (C x d) and ``global_mask`` (C,), i.e. ``C*d + C`` float32 numbers down per site, and every site uploads
    ``prototypes`` (C x d) and ``counts`` (C,), ``C*d + C`` numbers up. An upload that is not C x d, not finite,
    whose counts are not non-negative integers, disagree with the zero rows or do not add up to the site's
    ``n_train`` is dropped for that round with the reason logged (``HFLController.broadcast``).

    Args:
        num_classes (int), feature_dim (int): prototype shape C x d.
        prototypes (str): ``fedproto`` | ``fixed`` | ``tgp``. Default ``fedproto``.
        method_name (str): name recorded in the results, ``fedsaf`` or ``fedproto`` (the MSE + FedProto shorthand).
    """

    method = "fedsaf"

    def __init__(self, num_classes: int, feature_dim: int, prototypes: str = "fedproto", num_rounds: int = 1,
                 min_sites: int = 1, task_config: dict | None = None, task_timeout: int = 0, seed: int = 0,
                 method_name: str = "fedsaf", late_wait_s: int | None = None):
        super().__init__(num_rounds, min_sites, task_config, task_timeout, seed, late_wait_s)
        self.method_name = method_name
        self.method = method_name
        self.record["method"] = method_name
        self.num_classes = int(num_classes)
        self.feature_dim = int(feature_dim)
        self.prototypes = prototypes

    TASK_CONFIG_KEYS = {"lam": "lambda"}

    @classmethod
    def from_options(cls, method, profile, opts, common, task_config):
        # --method fedproto is shorthand for the coordinate (MSE) alignment with FedProto's weighted-mean prototypes,
        # run through the same two-level framework as FedSAF (the paper's "Ours-MSE"; issue 5): the catalogue fixes
        # its alignment and prototypes.
        dims = {cfg["model"].get("feature_dim") for cfg in profile.values()}
        if len(dims) != 1 or None in dims:
            raise ValueError(f"FedSAF needs one common feature_dim in every site's model spec, got {dims}")
        num_classes = next(iter(profile.values()))["model"]["num_classes"]
        tc = {**task_config, "alignment": opts["alignment"], "lambda": float(opts["lam"]),
              "gamma": float(opts["gamma"]), "eval": opts["eval"]}
        return cls(num_classes=num_classes, feature_dim=int(dims.pop()), prototypes=opts["prototypes"],
                   task_config=tc, method_name=method, **common)

    def run_method(self):
        import torch

        from hfl_components.alignment import (STRUCTURAL_KINDS, aggregate_fedproto, effective_rank,
                                              fixed_hypersphere_prototypes, train_tgp_prototypes)

        C, d = self.num_classes, self.feature_dim
        kind = self.task_config.get("alignment", "gcsa")
        self.record["notes"] = []
        if C == 2 and kind in STRUCTURAL_KINDS:
            msg = (f"{kind} with 2 classes: the prototype-level structural term is constant (centred 2x2 Gram / a "
                   f"single RDM entry), only the instance-level term acts; use labels 'subtype' (3 classes)")
            self.warning(msg)
            self.record["notes"].append(msg)
        if self.prototypes not in ("fedproto", "fixed", "tgp"):
            raise ValueError(f"unknown prototype construction {self.prototypes!r}")
        self.info(f"{self.method}: alignment {kind}, global prototypes {self.prototypes}, C x d = {C} x {d}, "
                  f"lambda {self.task_config.get('lambda')}, gamma {self.task_config.get('gamma')}, "
                  f"evaluation {self.task_config.get('eval') or 'head'}")
        fixed = np.asarray(fixed_hypersphere_prototypes(C, d, seed=self.seed), np.float32) \
            if self.prototypes == "fixed" else None
        gp, gmask, tgp_state = None, None, None
        self.record["effective_rank"] = []
        self.record["payload"] = {"unit": "bytes of float32 arrays per site",
                                  "theory": f"up C*d + C = {C * d + C} numbers; down 0 in round 0, then C*d + C",
                                  "per_round": []}
        for rnd in range(self.num_rounds):
            params = {}
            if gp is not None:
                params = {"global_prototypes": np.asarray(gp, np.float32), "global_mask": np.asarray(gmask, np.float32)}
            res = self.broadcast("fedsaf_train", rnd, params)
            _payload_round(self.record, rnd, 4 * (C * d + C), 0 if gp is None else 4 * (C * d + C))
            self.set_phase("averaging prototypes", round=rnd)
            t0 = time.perf_counter()
            P = [torch.as_tensor(np.asarray(r.params["prototypes"])) for r in res.values()]
            N = [torch.as_tensor(np.asarray(r.params["counts"])) for r in res.values()]
            stacked = torch.cat([p[n > 0] for p, n in zip(P, N)])
            er = float(effective_rank(stacked)) if len(stacked) else None
            self.record["effective_rank"].append(er)
            self.info(f"round {rnd}: effective rank of the {len(stacked)} stacked site prototypes "
                      f"({len(res)} sites) = {er if er is None else round(er, 4)} (max {min(len(stacked), d)})")
            if self.prototypes == "fedproto":
                gp, gmask = aggregate_fedproto(P, N)
            elif self.prototypes == "tgp":
                gp, gmask = train_tgp_prototypes(P, N, C, d, seed=self.seed, init=tgp_state)
                tgp_state = gp
            else:  # fixed (Eq. 4): the same hypersphere prototypes every round, all classes available
                gp, gmask = fixed, np.ones(C, bool)
            gp, gmask = np.asarray(gp, np.float32), np.asarray(gmask, bool)
            self.record["server_seconds"].setdefault("aggregation", 0.0)
            self.record["server_seconds"]["aggregation"] += time.perf_counter() - t0
        self.record["global_prototypes"] = None if gp is None else np.asarray(gp).tolist()
        self.final_evaluation(self.num_rounds)


# ============================================================================ FedTopo
class FedTopoController(HFLController):
    """FedTopo (paper 002, Algorithm 1): sites upload a C x C relation matrix R_k and class counts n_k; the
    server aggregates them with observation masks and harmonic reliability weights (Eq. 4-7), smooths with EMA
    (Eq. 8) and broadcasts (R^g, S^g): ``C*C + C`` float32 numbers up and ``2*C*C`` down per site and round.

    Uploads are validated (C x C, finite, in [0, 1], symmetric, counts (C,) finite and non-negative, and the unit
    diagonal of R_k marking exactly the classes with a positive count); a bad one is dropped for the round with
    the reason logged, and pairs no remaining site observed keep their previous global value (Eq. 8).

    Args:
        num_classes (int): C.
        rho (float): EMA factor (Eq. 8). Default 0.7.
        ablate (list): any of ``no_reliability``, ``no_ema`` (server side) and the site-side switches
            ``no_topq``, ``no_missing_mask``, ``local_topology`` (see ``topology.TopologyAblation``).
    """

    method = "fedtopo"

    def __init__(self, num_classes: int, rho: float = 0.7, ablate: list | None = None, num_rounds: int = 1,
                 min_sites: int = 1, task_config: dict | None = None, task_timeout: int = 0, seed: int = 0,
                 late_wait_s: int | None = None):
        super().__init__(num_rounds, min_sites, task_config, task_timeout, seed, late_wait_s)
        self.num_classes = int(num_classes)
        self.rho = float(rho)
        self.ablate = list(ablate or [])

    TASK_CONFIG_KEYS = {"lam": "lambda"}

    @classmethod
    def from_options(cls, method, profile, opts, common, task_config):
        from hfl_components.topology import TopologyAblation

        ablate = sorted(set(opts["ablate"] or []))
        TopologyAblation.from_names(ablate)  # ValueError on an unknown switch
        noisy = opts["noisy_counts"]
        tc = {**task_config, "lambda": float(opts["lam"]), "gamma": float(opts["gamma"]),
              "top_q": int(opts["top_q"]), "warmup": int(opts["warmup"]), "ablate": ablate,
              "noisy_counts": None if noisy is None else float(noisy)}
        num_classes = next(iter(profile.values()))["model"]["num_classes"]
        return cls(num_classes=num_classes, rho=float(opts["rho"]), ablate=ablate, task_config=tc, **common)

    def run_method(self):
        from hfl_components.topology import TopologyAblation, aggregate_topology, initial_topology, is_warmup_round

        C = self.num_classes
        tc = self.task_config
        abl = TopologyAblation.from_names(self.ablate)
        self.record["notes"] = []
        q = int(tc.get("top_q", 3))
        if abl.no_topq and TopologyAblation.topq_is_noop(q, C):
            msg = (f"ablation no_topq is identical to the default here: top_q = {q} >= C - 1 = {C - 1}, so the "
                   f"default already keeps every present negative")
            self.warning(msg)
            self.record["notes"].append(msg)
        if "no_topq" not in self.ablate and q > C - 1:
            self.record["notes"].append(f"top_q = {q} clipped to C - 1 = {C - 1}")
        warmup = int(tc.get("warmup", 3))
        if warmup >= self.num_rounds:
            msg = f"warm-up ({warmup} rounds) covers all {self.num_rounds} rounds: the topology loss never acts"
            self.warning(msg)
            self.record["notes"].append(msg)
        rho = abl.rho(self.rho)
        self.info(f"FedTopo: C = {C}, rho {rho}, reliability {not abl.no_reliability}, warm-up {warmup}, "
                  f"top_q {q}, lambda {tc.get('lambda')}, gamma {tc.get('gamma')}, ablations {self.ablate or 'none'}, "
                  f"noisy counts {tc.get('noisy_counts')}")
        R, S = initial_topology(C)
        self.record["topology_history"] = []
        self.record["payload"] = {"unit": "bytes of float32 arrays per site",
                                  "theory": f"up C*C + C = {C * C + C} numbers, down 2*C*C = {2 * C * C}",
                                  "per_round": []}
        for rnd in range(self.num_rounds):
            params = {"R_global": np.asarray(R, np.float32), "S_global": np.asarray(S, np.float32)}
            res = self.broadcast("fedtopo_train", rnd, params)
            _payload_round(self.record, rnd, 4 * (C * C + C), 4 * 2 * C * C)
            self.set_phase("aggregating topology", round=rnd)
            t0 = time.perf_counter()
            R, S = aggregate_topology([np.asarray(r.params["R"]) for r in res.values()],
                                      [np.asarray(r.params["counts"]) for r in res.values()],
                                      np.asarray(R), np.asarray(S), rho=rho, reliability=not abl.no_reliability)
            self.record["server_seconds"].setdefault("aggregation", 0.0)
            self.record["server_seconds"]["aggregation"] += time.perf_counter() - t0
            diag = {s: {k: (r.metrics or {}).get(k) for k in ("D_r", "D_rs")} for s, r in res.items()}
            self.record["topology_history"].append({
                "round": rnd, "warmup": is_warmup_round(rnd, warmup), "sites": list(res),
                "R": np.asarray(R).tolist(), "S": np.asarray(S).tolist(), "diagnostics": diag})
            self.info(f"round {rnd}: R^g off-diagonal {np.round(np.asarray(R)[~np.eye(C, dtype=bool)], 3).tolist()}, "
                      f"D^r/D^rs per site {diag}")
        self.record["R_global"] = np.asarray(R).tolist()
        self.record["S_global"] = np.asarray(S).tolist()
        self.final_evaluation(self.num_rounds)
