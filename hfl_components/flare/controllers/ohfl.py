"""OHFL (OHFL paper): one-shot upload, cross-layer OT fusion on the server, fine-tuning at the sites: the method's
NVFlare adapter (server controller and site handlers)."""
from __future__ import annotations

import json
import threading
import time

import logging

import numpy as np

from hfl_components.flare.controllers.base import HFLController, _jsonable
from hfl_components.flare.messages import GLOBAL_PREFIX, from_numpy_state, to_numpy_state
from hfl_components.flare.site_methods import ok_meta, option, task_epochs

log = logging.getLogger("cxr_hfl.site")


class ProbePreloader:
    """The OHFL probe at each site input size, prepared in one background thread from the moment the first site
    with that size uploads (:meth:`HFLController.on_site_result`), while slower sites still train.

    ``load(size)`` returns ``(tensor, file names, warnings)``. :meth:`get` waits for a size already started, or
    loads it now; either way the same function runs once per size, so the probe is the one a synchronous load
    gives. ``seconds`` sums the loading time of every size (the work, wherever it ran); ``waited`` is how long
    :meth:`get` blocked.
    """

    def __init__(self, load):
        self._load = load
        self._lock = threading.Lock()
        self._pool = None
        self._futures: dict = {}
        self.seconds = 0.0
        self.waited = 0.0

    def _timed(self, size: int):
        t0 = time.perf_counter()
        try:
            return self._load(size)
        finally:
            with self._lock:
                self.seconds += time.perf_counter() - t0

    def start(self, size: int):
        """Start preparing the probe at ``size`` (once); returns its future."""
        from concurrent.futures import ThreadPoolExecutor

        size = int(size)
        with self._lock:
            if size not in self._futures:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ohfl_probe")
                self._futures[size] = self._pool.submit(self._timed, size)
            return self._futures[size]

    def get(self, size: int):
        """The probe at ``size``: ``(tensor, file names, warnings)``; re-raises the loader's error."""
        t0 = time.perf_counter()
        try:
            return self.start(size).result()
        finally:
            self.waited += time.perf_counter() - t0

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)


_PRELOADER_LOCK = threading.Lock()


# ============================================================================ OHFL
class OHFLController(HFLController):
    """OHFL (OHFL paper): one-shot upload of depth/width-varying site models, cross-layer OT fusion on the server
    (CKA layer alignment Sec. 3.1, identity balancing Sec. 3.2, OT neuron alignment Sec. 3.3-3.4, multi-model
    aggregation Sec. 3.5 / Algorithm 1), then each site fine-tunes the global model.

    Args:
        strategy (str): ``cid`` | ``cdd`` | ``cia`` | ``rand``. Default ``cid``.
        alignment (str): ``cka`` | ``random``. Default ``cka``.
        ot_solver (str): ``emd`` | ``sinkhorn``. Default ``emd``.
        ground_metric (str): ``wts`` (the paper) | ``acts``. Default ``acts`` (chosen on the tuning part of
            chest_xray_224: ``docs/decisions.md``, ``studies/fusion_defaults/RESULTS.md``).
        probe (str): folder of public images for CKA, or ``generated`` (logged warning). Required.
        probe_size (int): number of probe images. Default 64.
        weighting (str): ``samples`` (cumulative sample counts) | ``half``. Default ``samples``.
        repair (str): ``none`` (the paper) | ``layer`` (one scale per fused hidden layer) | ``channel`` (REPAIR:
            every neuron's mean and std through the OT plan); ``hfl_components.fusion.repair``. True/False are read
            as ``layer``/``none``. Default ``channel``, with ``probe_at="own"`` (chosen on the tuning part of
            chest_xray_224: ``docs/decisions.md``, ``studies/fusion_defaults/RESULTS.md``).
        cka (str): ``linear`` (the paper's Eq. 1) | ``debiased`` | ``pooled``. Default ``linear``.
        probe_at (str): ``largest`` (every model probed at the largest site input size) | ``own`` (each model at
            its own input size, the same images; fused models at their target's size). Default ``own``.

        fusion_device (str): where the server runs the probe forward passes of fusion (CKA, repair):
            ``auto`` (CUDA when present) | ``cpu`` | ``cuda`` | ``cuda:N``. Default ``auto``.

    Site-side options travel in ``task_config``: ``init`` (``site`` | ``shared``: every site starts from the
    job seed's nested initialisation, ``hfl_components.models.fusable.shared_init_state``) and ``gate`` (a site
    deploys the fine-tuned global model only if it beats the site's own local model on its validation split). The
    gate's outcome per site is recorded under ``record["gate"]``. ``target_sensitivity``: the clinical operating
    point (:mod:`hfl_components.operating_point`): the sites' coarse validation histograms are pooled into one
    threshold, sent with the final evaluation; ``record["operating_point"]``.
    """

    method = "ohfl"

    def __init__(self, probe: str, strategy: str = "cid", alignment: str = "cka", ot_solver: str = "emd",
                 ground_metric: str = "acts", probe_size: int = 64, weighting: str = "samples",
                 repair: str | bool = "channel", num_rounds: int = 1, min_sites: int = 1, task_config: dict | None = None,
                 task_timeout: int = 0, seed: int = 0, late_wait_s: int | None = None, cka: str = "linear",
                 probe_at: str = "own", fusion_device: str = "auto"):
        super().__init__(num_rounds, min_sites, task_config, task_timeout, seed, late_wait_s)
        from hfl_components.training.device import check_device_name

        try:
            self.fusion_device = check_device_name(fusion_device)
        except ValueError as e:  # an edited job: name the argument
            raise ValueError(f"ohfl: fusion_device (--server-device) {e}") from None
        self.probe = probe
        self.strategy = strategy
        self.alignment = alignment
        self.ot_solver = ot_solver
        self.ground_metric = ground_metric
        try:
            self.probe_size = int(probe_size)
        except (TypeError, ValueError):  # an edited job: check_options names the option when the job starts
            self.probe_size = probe_size
        self.weighting = weighting
        from hfl_components.fusion.pairwise import repair_mode

        self.repair = repair_mode(repair)
        self.cka = cka
        self.probe_at = probe_at  # options are checked by catalogue.validate_options (build and job start)

    @property
    def _probes(self) -> ProbePreloader:
        """This run's probe preloader, made on first use (the controller itself stays free of locks and threads,
        so NVFlare can copy and export it)."""
        with _PRELOADER_LOCK:
            if "_probe_preloader" not in vars(self):
                self._probe_preloader = ProbePreloader(self._load_probe)
            return self._probe_preloader

    def check_server_inputs(self) -> None:
        """The probe set exists on the server and lists images (``generated`` needs none); checked at job start."""
        if self.probe != "generated":
            from hfl_components.flare.probe import list_probe_files

            if not list_probe_files(self.probe):
                raise FileNotFoundError(f"OHFL probe set {self.probe!r} on the server lists no images")

    def _load_probe(self, size: int):
        """The probe at one input size: (tensor, file names, warnings) (``hfl_components.flare.probe``)."""
        from hfl_components.flare.probe import load_probe

        names: list = []
        warns: list = []
        x = load_probe(self.probe, size, self.probe_size, in_channels=self._in_channels, seed=self.seed,
                       warn=warns.append, files_out=names)
        return x, names, warns

    _in_channels = 1  # the sites' image channels (from their specs; set when the first upload arrives)

    def on_site_result(self, task_name, model) -> None:
        """Round 0: start preparing the probe at this site's input size while the others still train (with
        ``probe_at="own"``; the largest size is known only when every site has answered)."""
        meta = model.meta or {}
        if task_name != "ohfl_train" or self.probe_at != "own" or meta.get("status") != "ok":
            return
        spec = meta.get("spec")
        if isinstance(spec, dict) and int(spec.get("in_channels", 1)) != 1:
            return  # multi-channel models: the probe is prepared after the round, with their channel count
        self._probes.start(int(meta.get("input_size", 64)))

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
                                "gate": bool(opts["gate"]),
                                "target_sensitivity": float(opts.get("target_sensitivity") or 0.95)}, **common)

    def run_method(self):
        from hfl_components.flare.messages import from_numpy_state, to_numpy_state
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
        in_ch = int(models[0]["spec"].get("in_channels", 1))
        if in_ch != self._in_channels:  # never preloaded (see on_site_result)
            self._in_channels = in_ch
        loaded = {sz: self._probes.get(sz) for sz in (sizes if self.probe_at == "own" else sizes[-1:])}
        self._probes.close()
        names = loaded[sizes[-1]][1]
        for w in loaded[sizes[-1]][2]:
            self.warning(w)
        probe = {sz: v[0] for sz, v in loaded.items()}
        if self.probe_at == "largest":
            probe = probe[sizes[-1]]
        # 'probe': the seconds spent preparing the probe (partly during round 0, in the background thread);
        # 'probe_wait': how long the server waited for it after the last upload
        self.record["server_seconds"]["probe"] = self._probes.seconds
        self.record["server_seconds"]["probe_wait"] = self._probes.waited
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
        gate, op_reports = {}, {}
        for site, r in ft.items():
            m = r.metrics or {}
            op_reports[site] = m.get("operating_point")
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
        from hfl_components.operating_point import federated_operating_point

        op = federated_operating_point(op_reports, float(self.task_config.get("target_sensitivity") or 0.95))
        self.record["operating_point"] = _jsonable(op) if op else {
            "skipped": "no site has a validation split with both classes to fit a temperature and send a histogram"}
        self.final_evaluation(2, meta={"operating_point": op} if op else None)
        if op:
            self.record["operating_point"]["site_sensitivity"] = {
                s: b["operating_point"] for s, b in self.record["sites"].items() if b.get("operating_point")}


# ============================================================================ site handlers
def ohfl_train(rt, params, meta):
    """OHFL step 1: train the site's own depth/width model and upload it once (with spec, count, val acc)."""
    tc = meta.get("task_config", {})
    rt.ensure_own_model(option(meta, "init"), option(meta, "init_seed"))
    hist = rt.train(task_epochs(rt, tc, "local_epochs", "local_epochs"), float(rt.cfg["lr"]), tag="local")
    rt.save_state()
    rt.save_model(rt.state_dir / "local_model.pt", kind="local")
    val = rt.evaluate("val")
    local_test = rt.evaluate("test")
    metrics = {"loss": [h["loss"] for h in hist], "val": val, "local": local_test}
    return to_numpy_state(rt.model.state_dict()), metrics, ok_meta(
        rt, spec=rt.spec, val_acc=float(val["accuracy"] or 0.0))


def _val_key(m: dict) -> tuple:
    """Ranking of a model on the site's validation split: AUC, then balanced accuracy, then lower log-loss."""
    def v(x, default=-1.0):
        return default if x is None else float(x)
    return (v(m.get("auc")), v(m.get("balanced_accuracy")), -v(m.get("log_loss"), 1e9))


def deployment_gate(fed_val: dict, local_val: dict) -> dict:
    """The deployment gate: adopt the federated model only if it beats the site's local model on validation.

    "Beats" means a strictly better (AUC, balanced accuracy, −log-loss) tuple, compared in that order, on the
    site's own validation split; a tie keeps the local model (a hospital should not switch models for nothing).

    Args:
        fed_val, local_val: :func:`hfl_components.training.compute_metrics` dicts of the two models on the split.

    Returns:
        ``{"adopted": bool, "federated_val": {auc, balanced_accuracy, log_loss}, "local_val": {...}, "reason": str}``.
    """
    keys = ("auc", "balanced_accuracy", "log_loss")
    fk, lk = _val_key(fed_val), _val_key(local_val)
    adopted = fk > lk
    def show(m):
        return ", ".join(f"{k} {m.get(k):.3f}" if m.get(k) is not None else f"{k} -" for k in keys)
    reason = (f"federated model beats the local model on validation ({show(fed_val)} vs {show(local_val)})" if adopted
              else f"federated model does not beat the local model on validation ({show(fed_val)} vs "
                   f"{show(local_val)}): keeping the local model")
    return {"adopted": bool(adopted), "federated_val": {k: fed_val.get(k) for k in keys},
            "local_val": {k: local_val.get(k) for k in keys}, "reason": reason}


def ohfl_finetune(rt, params, meta):
    """OHFL step 2: evaluate the global model zero-shot, fine-tune it at the site's input size, and deploy it --
    unless the deployment gate (option ``gate``, on by default) finds that it does not beat the site's own
    local model on the site's validation split, in which case the site keeps (deploys) its local model and says
    so in its log and in ``metrics["gate"]``. With the gate on, the fine-tuned federated candidate is also saved as
    ``federated_model.pt`` (kind ``federated``) whatever the gate decides. Then the site fits the deployed model's
    temperature and sends the coarse histogram of its calibrated validation scores (:func:`_operating_point_report`)."""
    tc = meta.get("task_config", {})
    rt.set_model(meta["global_spec"], from_numpy_state(params, GLOBAL_PREFIX))
    zero = rt.evaluate("test")
    hist = rt.train(task_epochs(rt, tc, "finetune_epochs", "finetune_epochs"), float(tc.get("finetune_lr") or rt.cfg["finetune_lr"]),
                    tag="finetune")
    fed_val = rt.evaluate("val")
    gate = None
    if option(meta, "gate"):
        from hfl_components.models import load_model_file

        local_model, local_header = load_model_file(rt.state_dir / "local_model.pt")
        # the fine-tuned federated candidate is kept whatever the gate decides (RUN/models/<site>_federated.pt),
        # so the gate's choice can be checked offline against both candidates
        rt.save_model(rt.state_dir / "federated_model.pt", kind="federated")
        fed_spec, fed_sd = rt.spec, {k: v.detach().cpu().clone() for k, v in rt.model.state_dict().items()}
        rt.set_model(local_header["spec"], local_model.state_dict())
        gate = deployment_gate(fed_val, rt.evaluate("val"))
        if gate["adopted"]:
            rt.set_model(fed_spec, fed_sd)
        log.warning("site %s: deployment gate: %s", rt.site, gate["reason"])
    rt.save_state(deployed=True)
    val = rt.evaluate("val", with_predictions=True)
    return {}, {"global_zero_shot": zero, "finetune_loss": [h["loss"] for h in hist], "val": val,
                "gate": gate, "operating_point": _operating_point_report(rt, val)}, ok_meta(rt)


def _operating_point_report(rt, val: dict) -> dict | None:
    """Clinical operating point, site side (:mod:`hfl_components.operating_point`): fit the deployed model's
    temperature on the validation split, keep it in the state folder
    (:data:`hfl_components.flare.site_methods.OPERATING_POINT_FILE`, until the server's threshold arrives with the
    final evaluation), and return what leaves the site (the temperature, ECE before/after, the coarse histogram of
    calibrated validation scores with its minimum count per bin); the per-image scores (``val["_probs"]``) are
    removed from ``val`` here and never sent. None for a validation split without both classes."""
    import json

    from hfl_components.flare.site_methods import OPERATING_POINT_FILE
    from hfl_components.operating_point import site_report

    probs, y = val.pop("_probs", None), val.pop("_labels", None)
    (rt.state_dir / OPERATING_POINT_FILE).unlink(missing_ok=True)
    if not probs or len({int(v > 0) for v in y}) < 2:
        return None
    rep = site_report(np.asarray(probs), np.asarray(y))
    (rt.state_dir / OPERATING_POINT_FILE).write_text(json.dumps({"temperature": rep["temperature"]}))
    return rep
