"""What a hospital site does for each task, independent of NVFlare (the Client API script only moves messages).

One :class:`SiteRuntime` per site process holds the site's config, its data pipeline and the model it keeps
between tasks. Everything a site keeps between tasks is also persisted in the site's own workspace
(``<workdir>/cxr_hfl_state/``), so a restarted site process continues where it left off.

Message conventions (plain numpy / JSON values only, see ../shared/docs/NVFLARE.md):

* server -> site: ``params`` = ``{"global.<key>": ndarray}`` for a global model (own key prefix, so a different
  architecture never collides with the site's own names); ``meta["task_config"]`` = method settings shared by all
  sites; ``meta["global_spec"]`` = the architecture of the global model; other arrays (prototypes, topology) as
  ``params`` under their own names.
* site -> server: ``params`` = arrays the method uploads; ``meta`` = ``{"status": "ok"|"error", "error": str,
  "n_train": int, ...}``; ``metrics`` = JSON-able evaluation results. A failing site answers with status
  ``error`` and a message naming the site, rather than crashing the federation.
"""
from __future__ import annotations

import logging
import secrets
import time
import zlib
from functools import partial
from pathlib import Path

import numpy as np
import torch

from hfl_components.flare.site_config import DEFAULTS as SITE_DEFAULTS
from hfl_components.models import build_model

log = logging.getLogger("cxr_hfl.site")

STATE_DIR = "cxr_hfl_state"
HOLDOUT = "holdout"  # the split SiteRuntime.hold_out sets aside from the training split


def _stratified_cap(rows: list[dict], n: int, seed: int) -> list[dict]:
    """At most ``n`` rows, class-stratified and seeded: :func:`chest_xray.sampling.stratified_subset`."""
    from chest_xray.sampling import stratified_subset

    return stratified_subset(rows, n, seed)


def find_image_error(exc: BaseException):
    """The :class:`chest_xray.ImageReadError` behind ``exc`` (itself, or anywhere in its ``__cause__`` /
    ``__context__`` chain, e.g. under MONAI's ``RuntimeError: applying transform <...Lambdad object at 0x...>``),
    else None."""
    from chest_xray import ImageReadError

    seen = set()
    e = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, ImageReadError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def describe_error(exc: BaseException) -> str:
    """``"<Type>: <message>"`` of a task failure, with an underlying ImageReadError (file and reason) in place of
    the wrappers MONAI puts around it. Used for the site log and (after path redaction) the reason the server
    records."""
    img = find_image_error(exc)
    if img is not None:
        return f"ImageReadError: {img}"
    return f"{type(exc).__name__}: {exc}"


def balanced_sampler(labels: list[int], generator: torch.Generator) -> torch.utils.data.WeightedRandomSampler:
    """Class-balanced sampling of one site's training split: image ``i`` of class ``c`` is drawn with probability
    ``1 / (K n_c)`` (K = classes present), with replacement, ``len(labels)`` draws per epoch, so each present class
    fills 1/K of an epoch in expectation (training under label skew). Raises ValueError on no labels."""
    y = np.asarray(labels, dtype=np.int64)
    if y.size == 0:
        raise ValueError("balanced sampling needs at least one training image")
    counts = np.bincount(y)
    w = 1.0 / counts[y].astype(np.float64)
    return torch.utils.data.WeightedRandomSampler(torch.as_tensor(w, dtype=torch.double), num_samples=int(y.size),
                                                  replacement=True, generator=generator)


def round_lr_factor(rnd: int, total_rounds: int) -> float:
    """Cosine learning-rate factor of round ``rnd`` (0-based) of ``total_rounds``: ``0.5 (1 + cos(pi r / R))``,
    1 at round 0 and decaying towards 0 at the last round (SGDR, Loshchilov & Hutter 2017, without restarts; the
    rate is constant within a round). Raises ValueError unless ``0 <= rnd < total_rounds``."""
    import math

    if not 0 <= rnd < total_rounds:
        raise ValueError(f"round {rnd} is outside 0..{total_rounds - 1}")
    return 0.5 * (1.0 + math.cos(math.pi * rnd / total_rounds))


class SiteRuntime:
    """A site's data, model and task handlers.

    Args:
        cfg: validated site config (see ``hfl_components.flare.site_config``).
        workdir: the site's workspace folder; state is kept under ``workdir/cxr_hfl_state``.

    Raises:
        ValueError: the config's ``device`` cannot be used here (the message names the config file).
    """

    HOLDOUT = HOLDOUT  # the split hold_out sets aside (handlers read it here: adapters do not import this module)

    def __init__(self, cfg: dict, workdir: str | Path):
        from hfl_components.training.device import describe_device, resolve_device

        self.cfg = cfg
        self.site = cfg["site"]
        try:
            self.device = resolve_device(cfg.get("device", "auto"))
        except ValueError as e:
            raise ValueError(f"site {self.site}: config {cfg.get('config_path', '<memory>')} key 'device': {e}") from None
        self.amp = bool(cfg.get("amp", False))
        log.info("site %s: device %s%s", self.site, describe_device(self.device), ", mixed precision" if self.amp else "")
        self.state_dir = Path(workdir) / STATE_DIR
        self.state_dir.mkdir(parents=True, exist_ok=True)
        torch.set_num_threads(int(cfg["threads"]))
        self.labels = cfg["data"]["labels"]
        self.num_classes = int(cfg["model"]["num_classes"])
        self._loaders: dict = {}
        self._rows = None
        self._holdout = 0.0  # fraction of the training split held back as the HOLDOUT split (hold_out)
        self.model = None
        self.spec = None
        self._ema = None  # torch.optim.swa_utils.AveragedModel of self._ema_src (site config weight_ema)
        self._ema_src = None
        self.method = None  # the method of the task being run (meta["method"], set by dispatch.handler)
        self.method_defaults = None  # that method's catalogue defaults (epochs a site config leaves out)
        self._manifest_sha = None
        self._dp_sessions: dict = {}  # "train" / "holdout" -> hfl_components.privacy.DPSession (site config dp)
        self._dp_count = None  # the released (noised or declared) training-set size under dp, fixed once per process
        # what the site is doing now (task, epoch, loss); the site script sends it to the server as a heartbeat
        self.progress: dict = {}
        self._load_state()

    # ---------------------------------------------------------------- data
    def rows(self, split: str) -> list[dict]:
        from chest_xray import read_site_manifest

        if self._rows is None:
            rows = read_site_manifest(self.cfg["data"]["manifest"])
            n_classes = 3 if self.labels == "subtype" else 2
            bad = next((r for r in rows if not 0 <= r["label"] < n_classes), None)
            if bad is not None:
                raise ValueError(f"site {self.site}: label {bad['label']} of {bad['path']} is out of range for the "
                                 f"{self.labels} scheme (0..{n_classes - 1}) in {self.cfg['data']['manifest']}")
            self._rows = rows
        out = [r for r in self._rows if r["split"] == ("train" if split == HOLDOUT else split)]
        if split in ("train", HOLDOUT) and self.cfg.get("max_train_images"):
            out = _stratified_cap(out, int(self.cfg["max_train_images"]), int(self.cfg["seed"]))
        if split in ("train", HOLDOUT) and self._holdout > 0 and len(out) > 1:
            n = min(len(out) - 1, max(1, round(self._holdout * len(out))))
            held = {id(r) for r in _stratified_cap(out, n, int(self.cfg["seed"]) + 1)}
            out = [r for r in out if (id(r) in held) == (split == HOLDOUT)]
        elif split == HOLDOUT:
            out = []
        return out

    def hold_out(self, fraction: float) -> None:
        """Set aside a class-stratified, seeded ``fraction`` of the training split (at least one image, never all)
        as the split :data:`HOLDOUT` (FENS's aggregator-training images); ``rows("train")``, the training loader
        and ``n_train`` then leave those images out. 0 holds none back. Call it before the first training task."""
        f = float(fraction)
        if not 0.0 <= f < 1.0:
            raise ValueError(f"site {self.site}: the held-out fraction must be in [0, 1), got {fraction}")
        if f != self._holdout:
            self._holdout = f
            self._loaders.clear()

    def loader(self, split: str, input_size: int | None = None, train_mode: bool | None = None):
        """A DataLoader over one split at the site's input size (train split augmented when train_mode)."""
        from chest_xray import make_site_dataset, resolve_augment_classes
        from chest_xray.transforms import BORDER_AUGMENTS

        size = int(input_size or self.input_size)
        train_mode = (split == "train") if train_mode is None else train_mode
        key = (split, size, train_mode)
        if key not in self._loaders:
            rows = self.rows(split)
            if not rows:
                raise ValueError(f"site {self.site}: the {split} split of {self.cfg['data']['manifest']} is empty")
            # the classes augmented in training ("all": every class, so augmentation is no label shortcut)
            aug = resolve_augment_classes(self.cfg["augment_classes"], self.rows("train"),
                                          self.num_classes) if train_mode else []
            collate = None
            tensor_path = train_mode and (self.cfg.get("fast_augment") or self.cfg.get("augment", SITE_DEFAULTS["augment"]) == "batch")
            # cached eval-mode tensors, built once (an unreadable file is reported, with its manifest line, there)
            base = self.loader(split, size, train_mode=False).dataset if tensor_path else None
            try:
                if tensor_path:
                    from chest_xray.batch_augment import BatchAugmentCollate, CachedTensorDataset
                    from chest_xray.transforms import TensorAugmentDataset

                    items = [base[i] for i in range(len(base))]
                    images = torch.stack([torch.as_tensor(it["image"]) for it in items])
                    labels = [int(it["label"]) for it in items]
                    if self.cfg.get("fast_augment"):  # flip + integer shift per item, no rotation
                        ds = TensorAugmentDataset(images, labels, augment_classes=aug)
                    else:  # the MONAI pipeline's flip + affine per collated batch, on the site's device
                        ds = CachedTensorDataset(images, labels)
                        collate = BatchAugmentCollate(aug, device=self.device)
                else:
                    ds = make_site_dataset(rows, size, "train" if train_mode else "eval", augment_classes=aug,
                                           cache_dir=self.cfg.get("cache_dir"),
                                           aspect=self.cfg.get("aspect", "stretch"),
                                           border_augment=(self.cfg.get("augment") if train_mode and self.cfg.get(
                                               "augment") in BORDER_AUGMENTS else False))
            except Exception as e:  # MONAI wraps a file that cannot be read: report the file and the reason
                img = find_image_error(e)
                if img is None:
                    raise
                raise self._located(img, split) from None
            g = torch.Generator().manual_seed(int(self.cfg["seed"]))
            sampler = None
            if train_mode and self.cfg.get("balanced_sampling"):
                sampler = balanced_sampler([int(r["label"]) for r in rows], g)
            self._loaders[key] = torch.utils.data.DataLoader(
                ds, batch_size=int(self.cfg["batch_size"]), shuffle=train_mode and sampler is None, sampler=sampler,
                num_workers=0, generator=g, collate_fn=collate)
        return self._loaders[key]

    def _located(self, err, split: str):
        """The ImageReadError ``err`` with its manifest row (1-based line of the CSV, header = line 1) added."""
        from chest_xray import ImageReadError

        where = ""
        for i, r in enumerate(self._rows or []):
            if str(r["path"]) == err.path:
                where = f" (manifest {self.cfg['data']['manifest']} line {i + 2}, {split} split)"
                break
        return ImageReadError(err.path, f"{err.reason}{where}; `cxr-hfl site check` lists every unreadable file")

    @property
    def input_size(self) -> int:
        """The side in pixels the site feeds its current model (loaders, saved model files): the model's own
        ``input_size`` where it declares one (FENS's ensemble: its largest member's, so that no member sees an
        upsampled image), else the site config's ``input_size``."""
        own = getattr(self.model, "input_size", None) if self.model is not None else None
        return int(own or self.cfg["input_size"])

    def n_train(self) -> int:
        return len(self.rows("train"))

    def class_counts(self) -> np.ndarray:
        c = np.zeros(self.num_classes, dtype=np.int64)
        for r in self.rows("train"):
            c[int(r["label"])] += 1
        return c

    # ---------------------------------------------------------------- model state
    def _load_state(self):
        from hfl_components.models import load_model_file

        p = self.state_dir / "model.pt"
        if p.is_file():
            model, header = load_model_file(p)
            self.spec, self.model = dict(header["spec"]), model.train()

    def manifest_sha256(self) -> str | None:
        """SHA-256 of the site's manifest file (provenance of the models it saves); None if unreadable."""
        from hfl_components.models.files import file_sha256

        if self._manifest_sha is None:
            try:
                self._manifest_sha = file_sha256(self.cfg["data"]["manifest"])
            except OSError:
                return None
        return self._manifest_sha

    def save_model(self, path: str | Path, kind: str) -> Path:
        """Save the current model as a model file (``hfl_components.models.save_model_file``) with this site's
        input size, label scheme and provenance (method of the last task, seed, manifest hash). ``kind="deployed"``
        saves :attr:`eval_model` (the weight average under ``weight_ema``), every other kind the trained weights."""
        from hfl_components.models import save_model_file

        model = self.eval_model if kind == "deployed" else self.model
        return save_model_file(path, self.spec, {k: v.detach().cpu() for k, v in model.state_dict().items()},
                               input_size=self.input_size, aspect=self.cfg.get("aspect"),
                               labels=self.labels, site=self.site, kind=kind,
                               operating_point=getattr(self, "operating_point", None) if kind == "deployed" else None,
                               population=getattr(self, "population_reference", None) if kind == "deployed" else None,
                               provenance={"method": self.method, "seed": int(self.cfg["seed"]),
                                           "manifest_sha256": self.manifest_sha256(), "dp": self.dp_record()})

    def set_model(self, spec: dict, state_dict: dict | None = None):
        self.spec = dict(spec)
        self.model = build_model(self.spec)
        if state_dict is not None:
            self.model.load_state_dict(state_dict)
        self.model.to(self.device)

    # ---------------------------------------------------------------- differential privacy (site config dp)
    @property
    def dp_spec(self):
        """The site config's ``dp`` as a :class:`hfl_components.privacy.DPSpec`, or None (no dp). Raises ValueError
        naming the site and file on a bad mapping."""
        raw = self.cfg.get("dp")
        if not raw:
            return None
        from hfl_components.privacy import DPSpec

        return DPSpec.from_config(raw, self.site, self.cfg.get("config_path", "<memory>"))

    def dp_session(self, key: str, n_images: int, epochs: int):
        """The site's DP-SGD session ``key`` (``train``: the training split; ``holdout``: FENS's held-out images, a
        disjoint set), planned on first use for ``epochs`` epochs over ``n_images`` images at the config's batch
        size (:func:`hfl_components.privacy.check_budget`: an impossible budget is refused here, before any step,
        in one line naming the site). None without dp. One session (one accountant) serves every later training
        call of the job with the same key; its plan must cover them all (the caller passes the job's total).
        The session's ledger is ``<state dir>/dp_<key>.json``: a site process restarted mid-job continues the
        job's spent steps and epsilon from it, and refuses to train when the plan changed or the file is
        unreadable (:class:`hfl_components.privacy.DPSession`)."""
        spec = self.dp_spec
        if spec is None:
            return None
        if key not in self._dp_sessions:
            from hfl_components.privacy import DPSession, check_budget

            plan = check_budget(int(n_images), int(self.cfg["batch_size"]), int(epochs), spec, self.site)
            log.warning("site %s: dp (%s): epsilon %g, delta %.3g, noise multiplier %.3f, sample rate %.4f, %d steps",
                        self.site, key, plan.target_epsilon, plan.delta, plan.noise_multiplier, plan.sample_rate,
                        plan.steps)
            # the noise seed comes from the OS's random source at this site, never from the job's seed: the server
            # and every peer know that one, and whoever knows the noise can subtract it
            session = DPSession(plan, seed=secrets.randbits(63), ledger=self.dp_ledger(key))
            if session.restored_steps:
                log.warning("site %s: dp (%s): continuing a restarted job: %d of %d steps already spent, epsilon %.3f",
                            self.site, key, session.restored_steps, plan.steps, session.epsilon())
            self._dp_sessions[key] = session
        return self._dp_sessions[key]

    def dp_ledger(self, key: str) -> Path:
        """The file where the dp session ``key`` keeps its plan and spent steps (``<state dir>/dp_<key>.json``)."""
        return self.state_dir / f"dp_{key}.json"

    def dp_record(self) -> dict | None:
        """What the site records of its DP-SGD (model-file provenance, the answers' ``meta["dp"]``):
        ``{"dp": True, "epsilon": the largest of its sessions' (disjoint image sets: parallel composition),
        "delta", "sessions": {key: DPSession.record()}}``; ``{"dp": False}`` without dp."""
        if self.dp_spec is None:
            return {"dp": False}
        recs = {k: s.record() for k, s in self._dp_sessions.items()}
        eps = max((r["epsilon"] for r in recs.values()), default=0.0)
        delta = max((r["delta"] for r in recs.values()), default=None)
        return {"dp": True, "epsilon": eps, "target_epsilon": float(self.dp_spec.epsilon), "delta": delta,
                "sessions": recs}

    def released_count(self, n: int) -> int:
        """The training-set size this site sends under dp: noised once with the discrete Laplace mechanism when the
        config sets ``dp.count_epsilon`` (:func:`hfl_components.privacy.noisy_count`, the same value in every answer
        of the job), else ``n`` (declared public to the consortium). Without dp, ``n``."""
        spec = self.dp_spec
        if spec is None or spec.count_epsilon is None:
            return int(n)
        if self._dp_count is None:
            from hfl_components.privacy import noisy_count

            self._dp_count = noisy_count(int(n), float(spec.count_epsilon))
        return int(self._dp_count)

    def dp_compatible(self, model):
        """``model`` ready for DP-SGD: as is without dp or when Opacus accepts it; a BatchNorm model (MONAI
        families) made compatible by Opacus's ``ModuleValidator.fix`` (BatchNorm -> GroupNorm, the trained weights of
        every other layer kept) and its spec marked ``norm: group``, so every party that rebuilds it from the spec
        (model files, FENS's ensemble, evaluation) builds the same modules
        (:func:`hfl_components.models.build_model`). In-place activations are turned off either way
        (:func:`hfl_components.privacy.make_compatible`)."""
        if self.dp_spec is None:
            return model
        from hfl_components.privacy import make_compatible

        fixed, rep = make_compatible(model)
        if rep["changed"]:
            log.warning("site %s: %s", self.site, rep["text"])
            self.spec = {**self.spec, "norm": "group"}
        return fixed.to(self.device)

    def ensure_own_model(self, init: str = "site", init_seed: int | None = None):
        """The site's own model, built on first use.

        ``init="site"``: seeded by the site's seed and name (every site starts elsewhere). ``init="shared"``: the
        job's shared, nested initialisation from ``init_seed`` (``models.fusable.shared_init_state``; fusable
        families only), so sites of the same architecture start from identical weights.
        """
        if self.model is None:
            if init == "shared":
                from hfl_components.models.fusable import shared_init_state
                from hfl_components.models.registry import is_fusable

                if not is_fusable(self.cfg["model"]):
                    raise ValueError(f"site {self.site}: shared initialisation needs a fusable model (cnn/vgg11), "
                                     f"got {self.cfg['model'].get('family')!r}")
                seed = int(self.cfg["seed"] if init_seed is None else init_seed)
                self.set_model(self.cfg["model"], shared_init_state(self.cfg["model"], seed))
            elif init == "site":
                torch.manual_seed(int(self.cfg["seed"]) + zlib.crc32(self.site.encode()) % 1000)  # stable across processes
                self.set_model(self.cfg["model"])
            else:
                raise ValueError(f"site {self.site}: unknown initialisation {init!r} (site or shared)")
        return self.model

    def save_state(self, deployed: bool = False):
        self.save_model(self.state_dir / "model.pt", kind="state")
        if deployed:
            self.save_model(self.state_dir / "deployed_model.pt", kind="deployed")

    def deploy_round(self, val: dict, rnd: int, extra_files: tuple[str, ...] = ()) -> bool:
        """Save this round's model as the site's state and, by the site config's ``deploy`` rule, as its deployed
        model; returns whether it was deployed.

        ``deploy: last``: every round is deployed (the last round's model is what the site keeps). ``deploy:
        best_val`` (model selection on validation): the round is deployed when its validation balanced
        accuracy ``val["balanced_accuracy"]`` (None counts as -1) is at least the best so far in this job (ties ->
        the later round); round 0 starts a new job's record. A validation split holding fewer than two classes
        (``val["class_counts"]``) cannot rank rounds by balanced accuracy -- it would favour the round predicting
        its one class most -- so such a site deploys every round, as under ``last``. The record (round, score) is kept in
        ``deploy_selection.json`` in the site's state folder; ``extra_files`` (names in the state folder, e.g. the
        local prototypes) are copied to ``deployed_<name>`` with the model so that the deployed model's companions
        match it. Never reads the test split.
        """
        import json
        import shutil

        self.save_state(deployed=False)
        rule = self.cfg.get("deploy", "last")
        counts = val.get("class_counts")
        if rule == "best_val" and counts is not None and sum(1 for c in counts if c > 0) < 2:
            rule = "last (validation split holds < 2 classes)"
        rec_path = self.state_dir / "deploy_selection.json"
        score = val.get("balanced_accuracy")
        score = -1.0 if score is None or not np.isfinite(score) else float(score)
        best = None
        if rule == "best_val" and int(rnd) > 0 and rec_path.is_file():
            best = json.loads(rec_path.read_text())
        if rule == "best_val" and best is not None and score < float(best["score"]):
            log.info("site %s: round %s validation balanced accuracy %.4f < %.4f (round %s): deployed model kept",
                     self.site, rnd, score, best["score"], best["round"])
            return False
        self.save_model(self.state_dir / "deployed_model.pt", kind="deployed")
        for name in extra_files:
            if (self.state_dir / name).is_file():
                shutil.copy2(self.state_dir / name, self.state_dir / f"deployed_{name}")
        rec_path.write_text(json.dumps({"rule": rule, "round": int(rnd), "score": score}))
        return True

    def load_deployed(self, extra_files: tuple[str, ...] = ()) -> bool:
        """Make the deployed model (``deployed_model.pt``, saved by :meth:`deploy_round`) the current model, with
        its ``deployed_<name>`` companions copied back over ``<name>``; only under ``deploy: best_val`` (under
        ``last`` the current model is the deployed one). Returns whether a model was loaded."""
        import shutil

        from hfl_components.models import load_model_file

        p = self.state_dir / "deployed_model.pt"
        if self.cfg.get("deploy", "last") != "best_val" or not p.is_file():
            return False
        model, header = load_model_file(p)
        self.spec, self.model = dict(header["spec"]), model.to(self.device)
        for name in extra_files:
            if (self.state_dir / f"deployed_{name}").is_file():
                shutil.copy2(self.state_dir / f"deployed_{name}", self.state_dir / name)
        return True

    # ---------------------------------------------------------------- training / evaluation
    def train(self, epochs: int, lr: float, aux_loss=None, tag: str = "train", rnd: int = 0,
              total_rounds: int | None = None, grad_clip: float | None = None,
              dp_epochs: int | None = None) -> list[dict]:
        """Train the site's model for ``epochs`` epochs at ``lr`` (scaled by :func:`round_lr_factor` when the site
        config sets ``lr_schedule: cosine`` and ``total_rounds`` is known) with the config's optimiser, the
        method's ``aux_loss`` added to the CE, and the gradient norm clipped at ``grad_clip`` (None: no clip; the
        method's option, e.g. the prototype methods' ``grad_clip``). Under the site config's ``dp`` the training is
        DP-SGD in the site's ``train`` session (:meth:`dp_session`), planned on the first call for ``dp_epochs``
        epochs (the whole job's training at this site; default ``epochs``)."""
        from hfl_components.training import train_local

        model = self.ensure_own_model()
        if epochs <= 0:
            return []
        dp = None
        if self.dp_spec is not None:  # without dp nothing here reads the training split's size
            model = self.model = self.dp_compatible(model)
            dp = self.dp_session("train", self.n_train(), int(dp_epochs or epochs))
        if self.cfg.get("lr_schedule", "constant") == "cosine" and total_rounds:
            lr = float(lr) * round_lr_factor(int(rnd), int(total_rounds))
            log.info("site %s %s: cosine schedule, round %s of %s, lr %.6f", self.site, tag, rnd, total_rounds, lr)
        cw = self.cfg["class_weights"]

        self.progress.update({"stage": tag, "epoch": 0, "epochs": int(epochs), "loss": None})

        def on_epoch(rec):
            self.progress.update({"epoch": rec.get("epoch"), "loss": rec.get("loss")})
            loss = rec.get("loss")
            log.info("site %s %s epoch %s/%s loss %.4f", self.site, tag, rec.get("epoch"), epochs,
                     float("nan") if loss is None else loss)

        decay = float(self.cfg.get("weight_ema") or 0.0)
        on_step = None
        if decay > 0:
            from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

            if self._ema_src is not model:  # a new model object (first round, fine-tuning start) starts a new average
                self._ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
                self._ema_src = model
            on_step = partial(self._ema.update_parameters, model)

        return train_local(model, self.loader("train"), epochs, lr=lr, momentum=float(self.cfg["momentum"]),
                           class_weights=cw, aux_loss=aux_loss, on_epoch=on_epoch,
                           optimizer=self._optimizer(model, lr), weight_decay=float(self.cfg.get("weight_decay", 0.0)),
                           grad_clip=grad_clip,
                           seed=int(self.cfg["seed"]) * 1000 + int(rnd), device=self.device, amp=self.amp,
                           on_step=on_step, dp=dp)

    @property
    def eval_model(self):
        """The model the site evaluates and deploys: under the site config's ``weight_ema: d`` (0 < d < 1) the
        exponential moving average of the trained weights *and* BatchNorm buffers, theta_ema <- d theta_ema +
        (1 - d) theta after every optimiser step (Polyak averaging; ``torch.optim.swa_utils.AveragedModel``,
        started from the weights of the first step's model and restarted whenever a new model object trains);
        otherwise (and before any step of the current model) :attr:`model` itself. The method's uploads
        (prototypes, relation matrices, weights) keep using :attr:`model`."""
        if self._ema is not None and self._ema_src is self.model:
            return self._ema.module
        return self.model

    def _optimizer(self, model, lr: float):
        """The local optimiser of the site config's ``optimizer`` key; None for ``sgd`` (``train_local`` makes a
        fresh SGD each call, as before). Adam / AdamW are kept for as long as the same model object trains, so
        their moment estimates carry over from one round to the next (a new model, e.g. a fine-tuning start, gets a
        fresh one); each call sets its learning rate to ``lr``."""
        kind = self.cfg.get("optimizer", "sgd")
        if kind == "sgd":
            return None
        if getattr(self, "_opt_model", None) is not model or getattr(self, "_opt_kind", None) != kind:
            cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind]
            self._opt = cls(model.parameters(), lr=float(lr), weight_decay=float(self.cfg.get("weight_decay", 0.0)))
            self._opt_kind, self._opt_model = kind, model
        for g in self._opt.param_groups:
            g["lr"] = float(lr)
        return self._opt

    def evaluate(self, split: str = "test", with_predictions: bool = False) -> dict:
        """Metrics of the current model on a split; with_predictions adds per-image probabilities and labels."""
        from hfl_components.training import compute_metrics, predict_proba

        probs, y = predict_proba(self.eval_model, self.loader(split, train_mode=False), device=self.device)
        m = compute_metrics(y, probs, self.num_classes)
        m["n"] = int(len(y))
        if with_predictions:
            m["_probs"] = probs.astype(np.float32).tolist()
            m["_labels"] = y.astype(int).tolist()
        return m

    def timed(self, fn, *a, **k):
        t0 = time.perf_counter()
        out = fn(*a, **k)
        return out, time.perf_counter() - t0
