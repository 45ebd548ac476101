"""The pooled-data reference ``central`` (not a federated method): its NVFlare adapter, the server controller and
its site handlers. The pure parts are :mod:`hfl_components.central`.

Every site sends its training images (in the simulator: their paths, with the bytes of the files counted as its
upload), one site trains one model of the profile's deepest architecture on their union at ``central_input_size``
px for the run's local epochs -- that site plays the central server, with its own training settings (site config:
optimiser, learning rate, batch size, augmentation) -- and every site installs that model and scores it on its own
test split at that size.
"""
from __future__ import annotations

import csv
import os
import time

from hfl_components.central import pool_rows, rows_digest, trainer_site
from hfl_components.flare.controllers.base import HFLController
from hfl_components.flare.messages import GLOBAL_PREFIX, from_numpy_state, to_numpy_state
from hfl_components.flare.site_methods import ok_meta, option, task_epochs

POOL_DIR = "central_pool"  # under the training site's state folder: the pooled manifest and the pooled runtime


class CentralController(HFLController):
    """Pooled training as a reference: ``central_share`` (each site's training images), ``central_train`` (the
    training site trains one model on their union; the other sites answer at once), ``central_install`` (every
    site installs it at ``central_input_size`` px), then the common ``evaluate``. Every site must answer every task
    (``min_sites`` is the number of sites): a pool that lacks a site is not the union.

    Records ``central``: ``{"sites": {site: {"n_train", "image_bytes"}}, "n_train", "digest", "trainer", "spec",
    "input_size", "epochs", "trained_digest", "trained_on_pool"}``; round 0's upload bytes are the image files' bytes.

    Args:
        global_spec (dict): the architecture of the pooled model (the profile's deepest).
        (others as :class:`HFLController`; ``central_input_size`` travels in ``task_config``)
    """

    method = "central"

    def __init__(self, global_spec: dict, num_rounds: int = 1, min_sites: int = 1, task_config: dict | None = None,
                 task_timeout: int = 0, seed: int = 0, late_wait_s: int | None = None,
                 entry_ref: str | None = None):
        super().__init__(num_rounds, min_sites, task_config, task_timeout, seed, late_wait_s, entry_ref)
        self.global_spec = dict(global_spec)

    @classmethod
    def from_options(cls, method, profile, opts, common, task_config):
        """The deepest spec of the profile; every site must answer (``min_sites`` = the number of sites)."""
        from hfl_components.models import deepest_spec

        return cls(global_spec=deepest_spec(profile), task_config={**task_config, **opts},
                   **{**common, "min_sites": len(profile)})

    def pool(self, shared: dict) -> list[dict]:
        """The union of the sites' answers to ``central_share`` (:func:`hfl_components.central.pool_rows`); writes
        ``record["central"]`` and counts each site's image bytes as its upload of that round."""
        rows = pool_rows({s: r.meta["rows"] for s, r in shared.items()})
        img = {s: int(r.meta.get("image_bytes") or 0) for s, r in shared.items()}
        last = self.record["rounds"][-1]
        for s, b in img.items():  # the message carried paths; what a real pool moves is the files
            last["bytes_up_per_site"][s] = last["bytes_up_per_site"].get(s, 0) + b
        last["bytes_up"] += sum(img.values())
        self.record["bytes_uploaded"] += sum(img.values())
        self.record["central"] = {
            "sites": {s: {"n_train": len(r.meta["rows"]), "image_bytes": img[s]} for s, r in shared.items()},
            "n_train": len(rows), "digest": rows_digest(rows), "spec": self.global_spec,
            "input_size": int(self.task_config["central_input_size"]),
            "trainer": trainer_site({s: r.meta.get("spec") for s, r in shared.items()}, self.global_spec)}
        return rows

    def run_method(self):
        shared = self.broadcast("central_share", 0)
        rows = self.pool(shared)
        rec = self.record["central"]
        self.info(f"central: {len(rows)} training images of {len(shared)} sites pooled; {rec['trainer']} trains "
                  f"{self.global_spec} at {rec['input_size']} px")
        meta = {"global_spec": self.global_spec, "input_size": rec["input_size"], "trainer": rec["trainer"]}
        t0 = time.perf_counter()
        res = self.broadcast("central_train", 1, {}, {**meta, "pooled_rows": rows})
        self.record["server_seconds"]["pooled_training_wait"] = time.perf_counter() - t0
        if rec["trainer"] not in res:
            raise RuntimeError(f"central: the training site {rec['trainer']} did not return the pooled model")
        ans = res[rec["trainer"]]
        rec.update({"epochs": ans.meta.get("epochs"), "trained_digest": ans.meta.get("digest"),
                    "trained_on_pool": ans.meta.get("digest") == rec["digest"], "loss": (ans.metrics or {}).get("loss")})
        weights = dict(ans.params)
        self.broadcast("central_install", 2, {GLOBAL_PREFIX + k: v for k, v in weights.items()}, meta)
        self.final_evaluation(2)
        self.record["global_spec"] = self.global_spec
        self._save_model(weights, rec["input_size"])

    def final_evaluation(self, rnd: int, params: dict | None = None, meta: dict | None = None) -> None:
        """The common final evaluation; each site's ``input_size`` is the pooled model's, which it was scored at."""
        super().final_evaluation(rnd, params, meta)
        for block in self.record["sites"].values():
            block["input_size"] = int(self.task_config["central_input_size"])

    def _save_model(self, weights: dict, size: int) -> None:
        from hfl_components.models import save_model_file

        save_model_file(self.results_dir() / "global_model.pt", self.global_spec, weights, input_size=size,
                        labels=self.record.get("labels"), kind="global",
                        provenance={"method": self.method, "seed": self.seed})


# ============================================================================ site handlers
def central_share(rt, params, meta):
    """Send this site's training images to the pool: their paths and labels (the simulator's sites share one
    file system) and the bytes of the files, which is what leaves the site."""
    rows = rt.rows("train")
    size = sum(os.path.getsize(r["path"]) for r in rows if os.path.isfile(r["path"]))
    return {}, {"n_train": len(rows)}, ok_meta(rt, spec=dict(rt.cfg["model"]), image_bytes=int(size),
                                               rows=[{"path": str(r["path"]), "label": int(r["label"])} for r in rows])


def central_train(rt, params, meta):
    """At the training site: train one model of ``meta["global_spec"]`` on the pooled rows at
    ``meta["input_size"]`` px for the run's local epochs, with this site's training settings, and upload it (the
    weights it deploys: the weight average under ``weight_ema``). Every other site answers at once with nothing."""
    if meta.get("trainer") != rt.site:
        return {}, {}, ok_meta(rt, spec=rt.spec)
    pooled = _pooled_runtime(rt, meta)
    epochs = task_epochs(rt, meta.get("task_config", {}), "local_epochs", "local_epochs")
    hist = pooled.train(epochs, float(rt.cfg["lr"]), tag="pooled")
    trained = pooled.rows("train")
    return to_numpy_state(pooled.eval_model.state_dict()), {"loss": [h["loss"] for h in hist]}, ok_meta(
        rt, spec=pooled.spec, epochs=epochs, n_pooled=len(trained), digest=rows_digest(trained))


def _pooled_runtime(rt, meta: dict):
    """A runtime like this site's (same class, same training settings) whose training split is the pooled rows,
    at the pooled model's architecture and input size, with no cap on training images (each site capped its own)."""
    d = rt.state_dir / POOL_DIR
    d.mkdir(parents=True, exist_ok=True)
    manifest = d / "pooled_train.csv"
    with manifest.open("w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(["path", "label", "split"])
        w.writerows([r["path"], int(r["label"]), "train"] for r in meta["pooled_rows"])
    cfg = {**rt.cfg, "input_size": int(meta["input_size"]), "model": dict(meta["global_spec"]),
           "max_train_images": None, "data": {**rt.cfg["data"], "manifest": str(manifest)}}
    pooled = type(rt)(cfg, d)
    pooled.method, pooled.method_defaults = rt.method, rt.method_defaults
    return pooled


def central_install(rt, params, meta):
    """Install the pooled model as this site's deployed model, fed at ``meta["input_size"]`` px (what the final
    ``evaluate`` and the saved model file use)."""
    option(meta, "central_input_size")  # the job's options reached the site
    rt.set_model(meta["global_spec"], from_numpy_state(params, GLOBAL_PREFIX))
    rt.model.input_size = int(meta["input_size"])
    rt.save_state(deployed=True)
    return {}, {}, ok_meta(rt, spec=rt.spec)
