"""OHFL (OHFL paper): one-shot upload, cross-layer OT fusion on the server, fine-tuning at the sites: the method's
NVFlare adapter (server controller; the site handlers live in :mod:`.ohfl_site` and are re-exported here, where the
method catalogue names them)."""
from __future__ import annotations

import json
import logging
import threading
import time

from hfl_components.flare.controllers._probe_preload import ProbePreloader
from hfl_components.flare.controllers.base import HFLController, jsonable
from hfl_components.flare.messages import GLOBAL_PREFIX, from_numpy_state, to_numpy_state

log = logging.getLogger("cxr_hfl.site")

_PRELOADER_LOCK = threading.Lock()
_IMPORT_LOCK = threading.Lock()


def _import_monai() -> None:
    """Import MONAI's transforms and networks in one thread at a time: the probe preloader (transforms) and the
    upload check of a MONAI family (networks) run in different threads, and two threads importing halves of MONAI
    at once can deadlock on its package imports (Python raises ``_DeadlockError``)."""
    with _IMPORT_LOCK:
        import monai.networks.nets  # noqa: F401
        import monai.transforms  # noqa: F401


from hfl_components.flare.distill_stage import (  # noqa: E402,F401 - the server stage's options live beside it
    DATA_FREE_MAX_SECONDS, DISTILL_MAX_SECONDS, NO_PROBE, check_probe_or_data_free)


# ============================================================================ OHFL
class OHFLController(HFLController):
    """OHFL (OHFL paper): one-shot upload of depth/width-varying site models, cross-layer OT fusion on the server
    (CKA layer alignment Sec. 3.1, identity balancing Sec. 3.2, OT neuron alignment Sec. 3.3-3.4, multi-model
    aggregation Sec. 3.5 / Algorithm 1), then each site fine-tunes the global model.

    Args:
        strategy (str): ``cid`` | ``cdd`` | ``cia`` | ``rand``. Default ``cid``.
        fusion_order (str): ``pairwise`` (every model fused pairwise) | ``group`` (cid / cdd: the models of one
            architecture merged at once, C2M3-style, ``hfl_components.fusion.group_merge``). The catalogue owns the
            default.
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

        fusion_device (str): where the server runs the probe forward passes of fusion (CKA, repair) and the
            distillation: ``auto`` (CUDA when present) | ``cpu`` | ``cuda`` | ``cuda:N``. Default ``auto``.
        distill_steps (int): after fusion, at most this many steps of ensemble distillation into each
            architecture group's global model (``hfl_components.flare.distill_stage``, FedDF, Lin et al. 2020,
            arXiv:2006.07242); 0 = fusion alone (the paper). The catalogue option ``distill_steps`` owns the default.
        distill_temperature (float): T of the soft targets (Hinton et al. 2015, arXiv:1503.02531). Default 2.
        distill_weights (str): teacher weights ``samples`` | ``score`` (validation AUC above chance) | ``equal``.
        distill_augment (bool): the sites' augmentation on the distillation images. Default False: teachers
            trained with class-dependent augmentation label augmented images by that cue.
        distill_teacher (str): ``average`` (the uploads' weighted ensemble) | ``stacked`` (a learned combination
            fitted on the probe's public labels, ``distill_stage.stacked_teacher``). The catalogue owns the default.
        distill_feature_weight (float): weight of the feature-distillation term beside the logits (similarity-
            preserving KD of ``distill_feature_layer``, Tung & Mori 2019, arXiv:1907.09682;
            ``hfl_components.fusion.feature_distill``); 0 = logits only. The catalogue owns the default (0, off).
        distill_feature_layer (str): the hidden layers it reads: ``penultimate`` | ``aligned`` (every hidden layer
            of a fusable global model, paired with the uploads' layers by OHFL's CKA + DP alignment,
            ``feature_distill.layer_plan``). The catalogue owns the default.
        distill_probe_size (int): probe images for distillation (the first ``probe_size`` of them are the fusion
            probe; a fifth is held aside to decide when to stop). Default 320 (the committed probe part).
        data_free (bool): distil on generator images instead (DENSE, Zhang et al. 2022, arXiv:2112.12371;
            ``hfl_components.fusion.datafree``), capped at ``data_free_rounds`` rounds and
            :data:`DATA_FREE_MAX_SECONDS`. With ``probe="none"`` it is required. Default False.
        data_free_rounds (int): the data-free budget cap. Default 20.
        site_specs (dict): {site: model spec} of the job's profile (a family with no upload gets a fresh model).

    Site-side options travel in ``task_config``: ``init`` (``site`` | ``shared``: every site starts from the
    job seed's nested initialisation, ``hfl_components.models.fusable.shared_init_state``) and ``gate`` (a site
    deploys the fine-tuned global model only if it beats the site's own local model on its validation split). The
    gate's outcome per site is recorded under ``record["gate"]``. ``target_sensitivity``: the clinical operating
    point (:mod:`hfl_components.operating_point`): the sites' coarse validation histograms are pooled into one
    threshold, sent with the final evaluation; ``record["operating_point"]``.
    """

    method = "ohfl"

    def __init__(self, *, probe: str, strategy: str, alignment: str, ot_solver: str, ground_metric: str,
                 probe_size: int, weighting: str, repair: str | bool, num_rounds: int, min_sites: int,
                 task_config: dict, task_timeout: int, seed: int, late_wait_s: int | None, cka: str, probe_at: str,
                 fusion_device: str, distill_steps: int, distill_temperature: float, distill_weights: str,
                 distill_augment: bool, distill_probe_size: int, data_free: bool, data_free_rounds: int,
                 site_specs: dict, distill_teacher: str, distill_feature_weight: float, distill_feature_layer: str,
                 fusion_order: str, entry_ref: str | None = None):
        super().__init__(num_rounds, min_sites, task_config, task_timeout, seed, late_wait_s, entry_ref)
        self.distill_steps = distill_steps
        self.distill_temperature = distill_temperature
        self.distill_weights = distill_weights
        self.distill_augment = distill_augment
        self.distill_teacher = distill_teacher
        self.distill_feature_weight = distill_feature_weight
        self.distill_feature_layer = distill_feature_layer
        self.distill_probe_size = distill_probe_size
        self.data_free = data_free
        self.data_free_rounds = data_free_rounds
        self.site_specs = dict(site_specs or {})
        from hfl_components.training.device import check_device_name

        try:
            self.fusion_device = check_device_name(fusion_device)
        except ValueError as e:  # an edited job: name the argument
            raise ValueError(f"ohfl: fusion_device (--server-device) {e}") from None
        self.probe = probe
        self.strategy = strategy
        self.fusion_order = fusion_order
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
        """The probe set exists on the server and lists images (``generated`` / ``none`` need none); checked at job
        start."""
        if self.probe not in ("generated", NO_PROBE):
            from hfl_components.flare.probe import list_probe_files

            if not list_probe_files(self.probe):
                raise FileNotFoundError(f"OHFL probe set {self.probe!r} on the server lists no images")

    def _load_probe(self, size: int):
        """The probe at one input size: (tensor, file names, warnings) (``hfl_components.flare.probe``)."""
        from hfl_components.flare.probe import load_probe

        _import_monai()
        names: list = []
        warns: list = []
        n = max(int(self.probe_size), int(self.distill_probe_size) if self._distill_on_probe else 0)
        x = load_probe("generated" if self.probe == NO_PROBE else self.probe, size, n,
                       in_channels=self._in_channels, seed=self.seed, warn=warns.append, files_out=names)
        return x, names, warns

    def validate_result(self, task, result) -> None:
        """The catalogue's upload check (any family: MONAI networks imported safely beside the probe thread)."""
        _import_monai()
        super().validate_result(task, result)

    @property
    def _distill_on_probe(self) -> bool:
        """The distillation reads the probe pool (not data-free, and steps to run)."""
        return int(self.distill_steps) > 0 and not self.data_free and self.probe != NO_PROBE

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

    def check_options(self) -> dict:
        """The catalogue check, then the cross-option rules: without a probe pool (``probe="none"``) the
        distillation must be data-free (or off); ``fusion_order="group"`` needs strategy cid or cdd. Raises
        ValueError naming the option."""
        checked = super().check_options()
        check_probe_or_data_free(self.probe, self.data_free, self.distill_steps)
        from hfl_components.flare.distill_stage import check_buildable, check_feature, check_teacher

        check_teacher(self.distill_teacher, self.probe, self.data_free, self.distill_augment)
        check_feature(self.distill_feature_weight, self.distill_feature_layer, self.data_free, self.distill_augment,
                      self.distill_steps)
        from hfl_components.fusion.aggregate import check_fusion_order

        check_fusion_order(self.strategy, self.fusion_order)

        check_buildable(self.site_specs)
        return checked

    @classmethod
    def from_options(cls, method, profile, opts, common, task_config):
        from hfl_components.flare.distill_stage import check_buildable

        site_specs = {site: cfg["model"] for site, cfg in profile.items()}
        check_buildable(site_specs)  # before any site trains: the site and its family are named
        check_probe_or_data_free(opts["probe"], opts["data_free"], opts["distill_steps"])
        from hfl_components.fusion.aggregate import check_fusion_order

        check_fusion_order(opts["strategy"], opts["fusion_order"])
        common = {**common, "num_rounds": 1}
        return cls(probe=str(opts["probe"]), strategy=opts["strategy"], fusion_order=opts["fusion_order"],
                   alignment=opts["alignment"],
                   ot_solver=opts["ot"], ground_metric=opts["ground_metric"], probe_size=int(opts["probe_size"]),
                   weighting=opts["weighting"], repair=opts["repair"], cka=opts["cka"], probe_at=opts["probe_at"],
                   fusion_device=opts["server_device"], distill_steps=opts["distill_steps"],
                   distill_temperature=opts["distill_temperature"], distill_weights=opts["distill_weights"],
                   distill_augment=bool(opts["distill_augment"]), distill_probe_size=opts["distill_probe_size"],
                   distill_teacher=opts["distill_teacher"], distill_feature_weight=opts["distill_feature_weight"],
                   distill_feature_layer=opts["distill_feature_layer"],
                   data_free=bool(opts["data_free"]), data_free_rounds=opts["data_free_rounds"], site_specs=site_specs,
                   task_config={**task_config, "init": opts["init"], "init_seed": common["seed"],
                                "gate": bool(opts["gate"]), "target_sensitivity": float(opts["target_sensitivity"])},
                   **common)

    def _probe_for(self, models: list) -> tuple[dict, list]:
        """The probe images at every input size of ``models`` (and of the sites that did not upload):
        ({size: tensor (n, C, S, S)}, file names). Records ``server_seconds.probe`` / ``probe_wait`` and
        ``record["probe"]``."""
        sizes = sorted({m["input_size"] for m in models})
        in_ch = int(models[0]["spec"].get("in_channels", 1))
        if in_ch != self._in_channels:  # never preloaded (see on_site_result)
            self._in_channels = in_ch
        loaded = {sz: self._probes.get(sz) for sz in sizes}
        self._probes.close()
        names = loaded[sizes[-1]][1]
        for w in loaded[sizes[-1]][2]:
            self.warning(w)
        # 'probe': the seconds spent preparing the probe (partly during round 0, in the background thread);
        # 'probe_wait': how long the server waited for it after the last upload
        self.record["server_seconds"]["probe"] = self._probes.seconds
        self.record["server_seconds"]["probe_wait"] = self._probes.waited
        self.record["probe"] = {"source": str(self.probe), "n": len(names) if names else self.probe_size,
                                "n_fusion": min(int(self.probe_size), len(names) if names else self.probe_size),
                                "sizes": sizes, "files": names}
        return {sz: v[0] for sz, v in loaded.items()}, names

    def _fuse_group(self, models: list, probe_all: dict, device) -> tuple[dict, dict, dict]:
        """The CKA + OT + CID fusion of one fusable group (``hfl_components.fusion.aggregate_models``)."""
        from hfl_components.fusion import aggregate_models

        sizes = sorted({m["input_size"] for m in models})
        n = int(self.probe_size)
        probe = {sz: probe_all[sz][:n] for sz in sizes}
        if self.probe_at == "largest":
            probe = probe[sizes[-1]]
        shape = {k: tuple(v.shape) for k, v in probe.items()} if isinstance(probe, dict) else tuple(probe.shape)
        self.info(f"OHFL: fusing {len(models)} site models with strategy {self.strategy} (fusion order "
                  f"{self.fusion_order}), alignment "
                  f"{self.alignment} ({self.cka} CKA), OT {self.ot_solver}/{self.ground_metric}, repair {self.repair}, "
                  f"probe {shape}")
        return aggregate_models(models, strategy=self.strategy, probe=probe, alignment=self.alignment,
                                ot_solver=self.ot_solver, ground_metric=self.ground_metric, weighting=self.weighting,
                                seed=self.seed, repair=self.repair, cka=self.cka, device=device,
                                fusion_order=self.fusion_order,
                                progress=lambda k, n: self.report_progress("fusion (pairwise fusions)", k, n))

    def _distill(self, students: dict, uploads: dict, probe_all: dict, device) -> dict:
        """Ensemble distillation into every group's student, in place of its state dict; returns the records
        (``distill_stage.distil_groups`` with this job's options)."""
        from hfl_components.flare.distill_stage import distil_groups, probe_labels

        labels = (probe_labels(self.probe, self.record["probe"]["files"], self.record["labels"])
                  if self.distill_teacher == "stacked" else None)
        return distil_groups(students, uploads, probe_all, device, steps=int(self.distill_steps),
                             temperature=float(self.distill_temperature), weighting=self.distill_weights,
                             augment=bool(self.distill_augment), data_free=bool(self.data_free),
                             data_free_rounds=int(self.data_free_rounds), in_channels=int(self._in_channels),
                             seed=self.seed, max_seconds=DATA_FREE_MAX_SECONDS if self.data_free else
                             DISTILL_MAX_SECONDS, log=self.stage_log("distillation (steps)"),
                             teacher=self.distill_teacher, labels=labels,
                             feature_weight=float(self.distill_feature_weight),
                             feature_layer=str(self.distill_feature_layer))

    def _save_group_models(self, students: dict, suffix: str = "") -> None:
        """One group: ``global_model.pt`` (distilled) / ``global_fused.pt`` (before distillation, ``suffix='_fused'``);
        several: ``global_models/<group><suffix>.pt`` and ``global_models/groups.json`` ({group: {sites, sizes}})."""
        from hfl_components.flare.messages import to_numpy_state
        from hfl_components.models import save_model_file

        if len(students) == 1:
            (g, st), = students.items()
            if suffix:
                save_model_file(self.results_dir() / "global_fused.pt", st["spec"], to_numpy_state(st["state_dict"]),
                                labels=self.record.get("labels"), kind="global",
                                provenance={"method": self.method, "seed": self.seed})
            else:
                self.save_global_model(st["spec"], to_numpy_state(st["state_dict"]))
            return
        d = self.results_dir() / "global_models"
        d.mkdir(exist_ok=True)
        for g, st in students.items():
            save_model_file(d / f"{g}{suffix}.pt", st["spec"], to_numpy_state(st["state_dict"]),
                            labels=self.record.get("labels"), kind="global",
                            provenance={"method": self.method, "seed": self.seed})

    def _references(self, uploads: dict, fused: dict, students: dict) -> dict:
        """Server seconds and download bytes of each one-shot reference point (``distill_stage.references``)."""
        from hfl_components.flare.distill_stage import references

        return references(uploads, fused, students, self.record["server_seconds"])

    def _finetune(self, params: dict, meta: dict) -> dict | None:
        """Round 1: every site fine-tunes the global model of its architecture; the gate's outcomes are recorded.
        Returns the federated operating point (:func:`hfl_components.operating_point.federated_operating_point`)."""
        from hfl_components.operating_point import describe, federated_operating_point

        ft = self.broadcast("ohfl_finetune", 1, params, meta)
        gate, op_reports, acceptance = {}, {}, {}
        for site, r in ft.items():
            m = r.metrics or {}
            op_reports[site] = m.get("operating_point")
            self.record["sites"].setdefault(site, {}).update({
                "global_zero_shot": jsonable(m.get("global_zero_shot")),
                "finetune_loss": jsonable(m.get("finetune_loss")),
                "gate": jsonable(m.get("gate"))})
            if m.get("gate") is not None:
                gate[site] = m["gate"]
            if m.get("acceptance") is not None:
                acceptance[site] = m["acceptance"]
                self.record["sites"][site]["acceptance"] = jsonable(m["acceptance"])
        if gate:
            adopted = sorted(s for s, g in gate.items() if g.get("adopted"))
            self.record["gate"] = {"adopted": len(adopted), "sites": len(gate), "adopted_sites": adopted,
                                   "kept_local": sorted(set(gate) - set(adopted))}
            self.info(f"deployment gate: {len(adopted)} of {len(gate)} sites adopted the federated model"
                      + (f"; kept their local model: {', '.join(self.record['gate']['kept_local'])}"
                         if len(adopted) < len(gate) else ""))
        if acceptance:  # the gate as the site acceptance check: each deployed model's own operating point
            from hfl_components.operating_point import acceptance_summary

            self.record["acceptance"] = jsonable(acceptance_summary(acceptance))
            self.record["operating_point"] = {"rule": "per-model", "sites": sorted(acceptance)}
            (self.warning if self.record["acceptance"]["refused"] else self.info)(
                self.record["acceptance"]["line"])
            return None
        op = federated_operating_point(op_reports, float(self.task_config["target_sensitivity"]))
        self.record["operating_point"] = jsonable(op) if op else {
            "skipped": "no site has a validation split with both classes to fit a temperature and send a histogram"}
        (self.warning if not op or op["threshold"] is None else self.info)(describe(self.record["operating_point"]))
        return op

    def _collect_uploads(self, uploads_raw: dict) -> tuple[list, dict]:
        """The sites' ``ohfl_train`` answers as fusion inputs ``(models, {site: model})`` (one dict per site: name,
        spec, state_dict, n_samples, val_acc, val_auc, input_size); records each site's local metrics."""
        from hfl_components.flare.messages import from_numpy_state

        models, uploads = [], {}
        for site, r in uploads_raw.items():
            self.record["sites"].setdefault(site, {})["local"] = jsonable((r.metrics or {}).get("local"))
            val = (r.metrics or {}).get("val") or {}
            m = {"name": site, "spec": r.meta["spec"], "state_dict": from_numpy_state(r.params),
                 "n_samples": int(r.meta["n_train"]), "val_acc": float(r.meta.get("val_acc", 0.0)),
                 "val_auc": val.get("auc"), "input_size": int(r.meta.get("input_size", 64))}
            models.append(m)
            uploads[site] = m
        return models, uploads

    def _fuse_groups(self, groups: dict, uploads: dict, probe_all: dict, device) -> dict:
        """Fuse every fusable architecture group (:meth:`_fuse_group`); returns ``{group: (spec, state)}``.
        Records the fusion time and phase seconds and writes ``alignment_record.json``."""
        from hfl_components.flare import distill_stage as ds

        t0 = time.perf_counter()
        fused, fusion_records = {}, {}
        for g, sites in ds.fusable_groups(groups, uploads).items():
            spec, state, record = self._fuse_group([uploads[s] for s in sites], probe_all, device)
            fused[g] = (spec, state)
            fusion_records[g] = record
        self.record["server_seconds"]["fusion_total"] = time.perf_counter() - t0
        if len(fusion_records) == 1:
            record = next(iter(fusion_records.values()))
            self.record["server_fusion_s"] = jsonable(record.get("phase_seconds", {}))
            (self.results_dir() / "alignment_record.json").write_text(json.dumps(jsonable(record), indent=1))
        elif fusion_records:
            self.record["server_fusion_s"] = {g: jsonable(r.get("phase_seconds", {}))
                                              for g, r in fusion_records.items()}
            (self.results_dir() / "alignment_record.json").write_text(json.dumps(jsonable(fusion_records),
                                                                                 indent=1))
        return fused

    def _global_message(self, students: dict, groups: dict) -> tuple[dict, dict]:
        """The fine-tuning broadcast ``(params, meta)`` of the global model(s): one group's model as is, or every
        group's model in one message, each site picking its own (``meta["site_groups"]``; writes
        ``global_models/groups.json``). Records ``global_spec`` / ``global_specs``."""
        from hfl_components.flare.messages import to_numpy_state

        if len(students) == 1:
            (g, st), = students.items()
            spec = st["spec"]
            self.record["global_spec"] = spec
            params = {GLOBAL_PREFIX + k: v for k, v in to_numpy_state(st["state_dict"]).items()}
            meta = {"global_spec": spec}
        else:  # every group's model in one message; each site picks its own (meta["site_groups"])
            self.record["global_specs"] = {g: st["spec"] for g, st in students.items()}
            params = {f"{GLOBAL_PREFIX}{g}/{k}": v for g, st in students.items()
                      for k, v in to_numpy_state(st["state_dict"]).items()}
            meta = {"global_specs": self.record["global_specs"], "site_groups": groups}
            (self.results_dir() / "global_models" / "groups.json").write_text(json.dumps(
                {g: {"sites": st["sites"], "spec": st["spec"]} for g, st in students.items()}, indent=1))
        return params, meta

    def run_method(self):
        from hfl_components.flare import distill_stage as ds

        models, uploads = self._collect_uploads(self.broadcast("ohfl_train", 0))
        site_specs = {**self.site_specs, **{s: u["spec"] for s, u in uploads.items()}}
        groups = ds.architecture_groups(site_specs)
        self.record["groups"] = {g: sorted(s for s, k in groups.items() if k == g) for g in set(groups.values())}
        self.set_phase("probing")
        probe_all, _ = self._probe_for(models)
        from hfl_components.training.device import describe_device, resolve_device

        device = resolve_device(self.fusion_device)
        self.record["fusion_device"] = describe_device(device)
        self.info(f"OHFL: fusion probe passes on {self.record['fusion_device']}")
        self.set_phase("fusing (CKA layer alignment, OT neuron alignment, averaging, repair)")
        fused = self._fuse_groups(groups, uploads, probe_all, device)
        students = ds.initial_students(groups, site_specs, uploads, fused)
        for g, st in students.items():  # a fresh model (a group without uploads) gets its weights here
            if st["state_dict"] is None:
                st["state_dict"] = ds.student_model(st, self.seed).state_dict()
        self._save_group_models(students, suffix="_fused")  # fusion alone: the reference `evaluate` scores
        t0 = time.perf_counter()
        if int(self.distill_steps) > 0 or self.data_free:
            self.set_phase("distilling (ensemble of the uploads into each architecture's global model)")
            self.record["distillation"] = jsonable(self._distill(students, uploads, probe_all, device))
        self.record["server_seconds"]["distillation"] = time.perf_counter() - t0
        self._save_group_models(students)
        self.record["references"] = self._references(uploads, fused, students)
        params, meta = self._global_message(students, groups)
        op = self._finetune(params, meta)
        self.final_evaluation(2, meta={"operating_point": op} if op else None)
        if op:  # each site's own sensitivity at the threshold beside the pooled one
            from hfl_components.operating_point import add_site_rates

            add_site_rates(self.record["operating_point"], self.record["sites"])
