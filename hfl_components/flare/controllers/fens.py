"""FENS (Allouah et al., "Revisiting Ensembling in One-Shot Federated Learning", NeurIPS 2024, arXiv:2411.07182):
the method's NVFlare adapter, its server controller and its site handlers.

Phase 1 (one-shot, as OHFL's local phase): every site trains its own model for ``local_epochs`` on its training split
less a held-out ``fens_holdout`` fraction, and uploads it once (task ``fens_local``). Phase 2: the server sends every
uploaded model to every site with the initial aggregator (round 1 of task ``fens_aggregate``); each site computes the
frozen models' outputs on its held-out images once, and for ``rounds`` FedAvg rounds trains the aggregator for
``fens_epochs`` epochs from the server's current weights and uploads it with its held-out image count; the server
averages (FedAvg's :class:`~hfl_components.flare.controllers.baselines.FedAvgController` round loop and aggregator
hook). A last ``fens_aggregate`` without training installs the final aggregator; every site deploys the same model:
the frozen site models + the aggregator (:mod:`hfl_components.models.ensemble`, family ``fens``), saved as its
deployed model and on the server as ``global_model.pt``. The maths: :mod:`hfl_components.training.aggregator`.
"""
from __future__ import annotations

import time

import numpy as np

from hfl_components.flare.controllers.baselines import FedAvgController
from hfl_components.flare.messages import GLOBAL_PREFIX, from_numpy_state, payload_bytes, to_numpy_state
from hfl_components.flare.site_methods import job_epochs, ok_meta, option, task_epochs

MEMBER_PREFIX = "member."  # "member.<i>.<key>": the i-th site model (meta["members"][i]) in the first round
OUTPUTS_FILE = "fens_outputs.npz"  # a site's cached member outputs on its held-out images


class FENSController(FedAvgController):
    """FENS's server (module docstring): one upload of every site's model, then ``num_rounds`` FedAvg rounds of the
    aggregator. The options (``fens_aggregator``, ``fens_hidden``, ``fens_residual``, ``fens_holdout``,
    ``fens_epochs``, ``fens_lr``) travel in ``task_config``. Records ``fens`` (members, spec, payload per part),
    ``payload``, ``references.fens`` and ``server_seconds`` (``bundle``: assembling the site models' message,
    ``aggregation``: the FedAvg averaging).

    Args: as :class:`~hfl_components.flare.controllers.HFLController`.
    """

    method = "fens"

    def __init__(self, num_rounds: int = 1, min_sites: int = 1, task_config: dict | None = None,
                 task_timeout: int = 0, seed: int = 0, late_wait_s: int | None = None, entry_ref: str | None = None):
        super().__init__(global_spec={}, num_rounds=num_rounds, min_sites=min_sites, task_config=task_config,
                         task_timeout=task_timeout, seed=seed, late_wait_s=late_wait_s, task_name="fens_aggregate",
                         entry_ref=entry_ref)
        self._installing = False

    @classmethod
    def from_options(cls, method, profile, opts, common, task_config):
        """The method's options go to the sites in ``task_config``."""
        return cls(task_config={**task_config, **opts}, **common)

    def validate_result(self, task: str, result) -> None:
        """The last ``fens_aggregate`` only installs the final aggregator: its answers carry no weights."""
        if task == self.task_name and self._installing:
            return
        super().validate_result(task, result)

    def ensemble_spec(self, uploads: dict) -> dict:
        """The ``fens`` spec of the uploads ({site: FLModel}, in site order) with the job's aggregator options."""
        from hfl_components.models.ensemble import ensemble_spec

        specs = [r.meta["spec"] for r in uploads.values()]
        tc = self.task_config
        return ensemble_spec(specs, [int(r.meta["input_size"]) for r in uploads.values()],
                             int(specs[0].get("num_classes", 2)), tc["fens_aggregator"], int(tc["fens_hidden"]),
                             bool(tc["fens_residual"]), int(specs[0].get("in_channels", 1)))

    def run_method(self):
        import torch

        from hfl_components.models import save_model_file
        from hfl_components.models.ensemble import Aggregator

        uploads = self.broadcast("fens_local", 0)
        t0 = time.perf_counter()
        spec = self.ensemble_spec(uploads)
        bundle = {f"{MEMBER_PREFIX}{i}.{k}": v for i, r in enumerate(uploads.values()) for k, v in r.params.items()}
        torch.manual_seed(self.seed)
        weights = to_numpy_state(Aggregator(len(uploads), spec["num_classes"], spec["aggregator"], spec["hidden"],
                                            spec["residual"]).state_dict())
        self._expected = {k: v.shape for k, v in weights.items()}
        self.record["server_seconds"]["bundle"] = time.perf_counter() - t0
        self.info(f"fens: {len(uploads)} site models to every site, then {self.num_rounds} aggregator rounds")
        meta = {"ensemble_spec": spec, "members": list(uploads)}
        weights = self.run_rounds(weights, meta, first=1, first_params=bundle)
        self._installing = True
        final = {GLOBAL_PREFIX + k: v for k, v in weights.items()}
        self.broadcast(self.task_name, self.num_rounds + 1, final, {**meta, "install_only": True})
        self._installing = False
        self.final_evaluation(self.num_rounds + 1)
        self._record_fens(spec, uploads, bundle, weights)
        state = {**{f"members.{i}.{k}": v for i, r in enumerate(uploads.values()) for k, v in r.params.items()},
                 **{f"aggregator.{k}": v for k, v in weights.items()}}
        self.record["global_spec"] = spec
        # the deployed ensemble, at its own input size (its largest member's), for `evaluate`
        save_model_file(self.results_dir() / "global_model.pt", spec, state, input_size=max(spec["member_sizes"]),
                        labels=self.record.get("labels"), kind="global",
                        provenance={"method": self.method, "seed": self.seed})

    def _record_fens(self, spec: dict, uploads: dict, bundle: dict, weights: dict) -> None:
        """``record["fens"]``, ``record["payload"]`` and ``record["references"]["fens"]`` (bytes of float32 arrays
        per site: the site models once, the aggregator every round)."""
        agg, members, rounds = payload_bytes(weights), payload_bytes(bundle), self.num_rounds
        up_model = {s: payload_bytes(r.params) for s, r in uploads.items()}
        secs = self.record["server_seconds"]
        self.record["fens"] = {
            "members": list(uploads), "aggregator": {k: spec[k] for k in ("aggregator", "hidden", "residual")},
            "member_sizes": spec["member_sizes"], "rounds": rounds,
            "aggregator_epochs": self.task_config["fens_epochs"], "holdout": self.task_config["fens_holdout"],
            "aggregator_bytes": agg, "site_models_bytes": members}
        self.record["payload"] = {
            "down_per_site": {"site_models_once": members, "aggregator_per_round": agg,
                              "aggregator_rounds": rounds + 1, "total": members + agg * (rounds + 1)},
            "up_per_site": {"own_model_once": up_model, "aggregator_per_round": agg, "aggregator_rounds": rounds}}
        self.record["peer_model_bytes"] = up_model  # every site receives every other site's model once
        self.record.setdefault("references", {})["fens"] = {
            "server_seconds": secs.get("bundle", 0.0) + secs.get("aggregation", 0.0),
            "bytes_down_per_site": members + agg * (rounds + 1),
            "bytes_up_per_site": {s: b + agg * rounds for s, b in up_model.items()}}

    @staticmethod
    def payload_summary(profile: dict, opts: dict) -> str:
        """What the job sends, for ``export-job``: every site's model to every site once, the aggregator every
        round, with their float32 bytes for this profile (``opts``: the job options: ``rounds``, the fens
        options)."""
        import torch

        from hfl_components.models import build_model
        from hfl_components.models.ensemble import ensemble_spec

        specs = [dict(c["model"]) for c in profile.values()]
        spec = ensemble_spec(specs, None, int(specs[0].get("num_classes", 2)), opts["fens_aggregator"],
                             int(opts["fens_hidden"]), bool(opts["fens_residual"]))
        with torch.device("meta"):
            model = build_model(spec)
        member = sum(4 * p.numel() for p in model.members.state_dict().values())
        agg = sum(4 * p.numel() for p in model.aggregator.state_dict().values())
        r = int(opts["rounds"])
        return (f"the server sends every site's model to every site once ({member} bytes per site, {len(specs)} "
                f"models), then the aggregator each of {r} rounds and once more to install it ({agg} bytes per "
                f"round); each site uploads its own model once and its aggregator each round ({agg} bytes)")


# ============================================================================ site handlers
def fens_local(rt, params, meta):
    """FENS phase 1 at a site: hold out ``fens_holdout`` of the training split, train the site's own model on the
    rest for ``local_epochs``, keep it as the site's local model and upload it once."""
    tc = meta.get("task_config", {})
    _refuse_distill_under_dp(rt, meta)
    rt.hold_out(option(meta, "fens_holdout"))
    # under dp both budgets are checked before any training: the site model's and the aggregator's (its own
    # session over the held-out images, every aggregator round of the job: meta total_rounds)
    rt.dp_session("holdout", len(rt.rows(rt.HOLDOUT)), job_epochs(meta, int(option(meta, "fens_epochs"))))
    rt.ensure_own_model()
    hist = rt.train(task_epochs(rt, tc, "local_epochs", "local_epochs"), float(rt.cfg["lr"]), tag="local")
    rt.save_state()
    rt.save_model(rt.state_dir / "local_model.pt", kind="local")
    val = rt.evaluate("val")
    return to_numpy_state(rt.model.state_dict()), {"loss": [h["loss"] for h in hist], "val": val}, ok_meta(
        rt, spec=rt.spec)


def _install(rt, params: dict, meta: dict) -> None:
    """Make the site's model the ensemble of ``meta["ensemble_spec"]`` with the server's aggregator: built from the
    site models in ``params`` when they come (first round), else the one kept from earlier rounds; saved as the
    site's state and deployed model."""
    from hfl_components.models.ensemble import EnsembleNet

    agg = from_numpy_state(params, GLOBAL_PREFIX)
    if any(k.startswith(MEMBER_PREFIX) for k in params):
        state = {"members." + k: v for k, v in from_numpy_state(params, MEMBER_PREFIX).items()}
        rt.set_model(meta["ensemble_spec"], {**state, **{"aggregator." + k: v for k, v in agg.items()}})
        (rt.state_dir / OUTPUTS_FILE).unlink(missing_ok=True)  # new site models: new outputs
    elif not isinstance(rt.model, EnsembleNet) or rt.spec != meta["ensemble_spec"]:
        raise ValueError(f"site {rt.site}: no FENS ensemble kept from the first aggregator round (did this site "
                         "miss it?)")
    else:
        rt.model.aggregator.load_state_dict(agg)
    rt.save_state(deployed=True)


def _member_outputs(rt) -> tuple[np.ndarray, np.ndarray]:
    """(Z (N, M, C) members' log-probabilities, y (N,)) on the held-out images, computed once and kept in the
    site's state folder."""
    from hfl_components.training import extract_features

    f = rt.state_dir / OUTPUTS_FILE
    if f.is_file():
        with np.load(f) as d:
            return d["z"], d["y"]
    z, y = extract_features(rt.model, rt.loader(rt.HOLDOUT, train_mode=False), device=rt.device)
    np.savez(f, z=z, y=y)
    return z, y


def fens_aggregate(rt, params, meta):
    """FENS phase 2 at a site, one FedAvg round: install the server's aggregator (and, in the first round, every
    site's model) as the deployed ensemble, then train the aggregator for ``fens_epochs`` on the frozen models'
    outputs of the held-out images and upload it with their count (``NUM_STEPS_CURRENT_ROUND``). With
    ``meta["install_only"]`` (the last call) nothing is trained or uploaded."""
    from hfl_components.training.aggregator import aggregator_class_weights, train_aggregator

    rt.hold_out(option(meta, "fens_holdout"))
    _install(rt, params, meta)
    if meta.get("install_only"):
        if int(option(meta, "fens_distill_epochs")) > 0:
            return {}, _distil_at_site(rt, meta), ok_meta(rt, spec=rt.spec)
        return {}, {}, ok_meta(rt, spec=rt.spec)
    z, y = _member_outputs(rt)
    rnd = int(meta.get("round", 0))
    cw = aggregator_class_weights(y, rt.num_classes, rt.cfg.get("class_weights"))
    epochs = int(option(meta, "fens_epochs"))
    # under dp: the held-out images (disjoint from the members' training images) in their own session
    dp = rt.dp_session("holdout", int(len(y)), job_epochs(meta, epochs))
    hist = train_aggregator(rt.model.aggregator, z, y, epochs, float(option(meta, "fens_lr")),
                            int(rt.cfg["batch_size"]), seed=int(rt.cfg["seed"]) * 1000 + rnd, class_weights=cw, dp=dp)
    n = rt.released_count(int(len(y))) if rt.dp_spec is not None else int(len(y))
    return to_numpy_state(rt.model.aggregator.state_dict()), {"loss": [h["loss"] for h in hist]}, ok_meta(
        rt, spec=rt.spec, NUM_STEPS_CURRENT_ROUND=n, n_holdout=n)


DISTILL_TEMPERATURE = 2.0  # the site distillation's T (Hinton et al. 2015)
DISTILL_ALPHA = 0.5  # weight of the soft-target term; the labels' CE gets 1 - alpha


def _refuse_distill_under_dp(rt, meta: dict) -> None:
    """Raise ValueError naming the site when ``fens_distill_epochs`` > 0 under the site config's dp: the
    distillation pass over the training images would spend privacy budget that no DP session plans."""
    if int(option(meta, "fens_distill_epochs")) > 0 and rt.dp_spec is not None:
        raise ValueError(f"site {rt.site}: fens_distill_epochs > 0 is not supported under the site config's dp "
                         "(the distillation pass over the training images is not covered by any DP session)")


def _distil_at_site(rt, meta: dict) -> dict:
    """With ``fens_distill_epochs`` > 0, after the final aggregator is installed: distil the FENS ensemble (teacher,
    frozen) into the site's own model (started from its ``local_model.pt``) on its own training images
    (un-augmented), deploy that one model and delete the ensemble -- every peer model -- from the site's state
    (``model.pt`` and ``deployed_model.pt`` are overwritten, the cached member outputs removed). Returns the
    distillation's metrics."""
    import torch

    from hfl_components.models import load_model_file
    from hfl_components.training.loop import unpack_batch
    from hfl_components.training.site_distill import distil_student, teacher_logits

    _refuse_distill_under_dp(rt, meta)
    student, header = load_model_file(rt.state_dir / "local_model.pt")
    s_size = int(header.get("input_size") or rt.cfg["input_size"])

    def tensors(size):
        xs, ys = zip(*(unpack_batch(b) for b in rt.loader("train", size, train_mode=False)))
        return torch.cat(xs), torch.cat(ys).long()

    x_t, y = tensors(rt.input_size)
    targets = teacher_logits(rt.model, x_t, int(rt.cfg["batch_size"]), rt.device)
    x_s, y_s = tensors(s_size) if s_size != rt.input_size else (x_t, y)
    if not torch.equal(y, y_s):
        raise ValueError(f"site {rt.site}: the training images came in another order at {s_size} px")
    student.to(rt.device)
    hist = distil_student(student, x_s, targets, y, int(option(meta, "fens_distill_epochs")), float(rt.cfg["lr"]),
                          float(rt.cfg["momentum"]), int(rt.cfg["batch_size"]), DISTILL_TEMPERATURE, DISTILL_ALPHA,
                          seed=int(rt.cfg["seed"]), device=rt.device)
    rt.set_model(dict(header["spec"]), student.state_dict())
    rt.save_state(deployed=True)  # the ensemble (every peer model) is overwritten in model.pt / deployed_model.pt
    (rt.state_dir / OUTPUTS_FILE).unlink(missing_ok=True)
    val = rt.evaluate("val")
    return {"distill_loss": [h["loss"] for h in hist], "val": val, "distill_epochs": len(hist)}
