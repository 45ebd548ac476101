"""A new federated method touches three places: its pure module, its catalogue entry with its controller,
and its tests. Here all three live in this one file: "FedAvg with server momentum" (FedAvgM, Hsu et al. 2019,
"Measuring the effects of non-identical data distribution", Sec. 3) is defined, registered and run -- in process and
in the NVFlare simulator -- without editing any other file of the platform.

The module registers its entry when imported, so the simulator's server (which rebuilds the controller from the
job's class path ``tests.test_toy_method.MomentumFedAvgController``) knows the method too."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hfl_components.flare import catalogue
from hfl_components.flare.controllers import FedAvgController
from hfl_components.flare.messages import GLOBAL_PREFIX, to_numpy_state
from tests.deploy_helpers import REPO_ROOT, tiny_manifests, tiny_profile


# ------------------------------------------------------------------------------------ 1. the pure module
def server_momentum_step(global_w: dict, avg_w: dict, buffer: dict | None, lr: float, beta: float):
    """FedAvgM's server step: pseudo-gradient ``d = w - avg``, ``v <- beta * v + d``, ``w <- w - lr * v``.
    With ``beta = 0`` and ``lr = 1`` this is plain FedAvg (``w <- avg``). Returns ``(new_w, new_buffer)``."""
    buffer = buffer or {k: np.zeros_like(v) for k, v in global_w.items()}
    new_buf = {k: beta * buffer[k] + (global_w[k] - avg_w[k]) for k in global_w}
    return {k: (global_w[k] - lr * new_buf[k]).astype(np.float32) for k in global_w}, new_buf


# ------------------------------------------------------------------------------------ 2. the controller + entry
class MomentumFedAvgController(FedAvgController):
    """FedAvg on the profile's deepest architecture, with a server momentum step after each average."""

    method = "fedavg_momentum"

    def __init__(self, global_spec: dict, server_lr: float = 1.0, momentum: float = 0.9, num_rounds: int = 1,
                 min_sites: int = 1, task_config: dict | None = None, task_timeout: int = 0, seed: int = 0,
                 late_wait_s: int | None = None, entry_ref: str | None = None):
        super().__init__(global_spec, num_rounds, min_sites, task_config, task_timeout, seed, late_wait_s,
                         entry_ref=entry_ref)
        self.server_lr = float(server_lr)
        self.momentum = float(momentum)

    @classmethod
    def from_options(cls, method, profile, opts, common, task_config):
        from hfl_components.models import deepest_spec

        return cls(global_spec=deepest_spec(profile), server_lr=opts["server_lr"], momentum=opts["momentum"],
                   task_config=task_config, **common)

    def run_method(self):
        import torch

        from hfl_components.aggregation import weighted_average
        from hfl_components.models import build_model

        torch.manual_seed(self.seed)
        weights = to_numpy_state(build_model(self.global_spec).state_dict())
        self._expected = {k: v.shape for k, v in weights.items()}
        meta, buf = {"global_spec": self.global_spec}, None
        self.record["server_step_norm"] = []
        for rnd in range(self.num_rounds):
            res = self.broadcast("fedavg_train", rnd, {GLOBAL_PREFIX + k: v for k, v in weights.items()}, meta)
            avg = weighted_average([r.params for r in res.values()],
                                   [float(r.meta["NUM_STEPS_CURRENT_ROUND"]) for r in res.values()])
            new, buf = server_momentum_step(weights, avg, buf, self.server_lr, self.momentum)
            self.record["server_step_norm"].append(float(np.sqrt(sum(((new[k] - weights[k]) ** 2).sum()
                                                                     for k in new))))
            weights = new
        self.record["global_spec"] = self.global_spec
        self.final_evaluation(self.num_rounds, {GLOBAL_PREFIX + k: v for k, v in weights.items()}, meta)
        self.save_global_model(self.global_spec, weights)


ENTRY = catalogue.register(catalogue.MethodEntry(
    "fedavg_momentum", f"{__name__}.MomentumFedAvgController",
    {"fedavg_train": "hfl_components.flare.controllers.baselines:fedavg_train"},  # FedAvg's site handler
    options=(catalogue.Option("server_lr", float, 1.0, None, "server learning rate",
                              check=lambda v: None if v > 0 else f"must be > 0, got {v}"),
             catalogue.Option("momentum", float, 0.9, None, "server momentum beta",
                              check=lambda v: None if 0 <= v < 1 else f"must lie in [0, 1), got {v}")),
    upload_checks={"fedavg_train": "hfl_components.upload_checks:check_fedavg_upload"},
    uploads="the full model (every weight) and its training sample count, every round",
    summary="FedAvg with server momentum (test-only toy method)"))


# ------------------------------------------------------------------------------------ 3. the tests
def test_server_momentum_step_hand_computed():
    w, avg, buf = {"a": np.array([1.0, 2.0])}, {"a": np.array([0.0, 2.0])}, {"a": np.array([0.5, 0.0])}
    new, nb = server_momentum_step(w, avg, buf, lr=1.0, beta=0.9)
    assert np.allclose(nb["a"], [1.45, 0.0]) and np.allclose(new["a"], [-0.45, 2.0])
    plain, _ = server_momentum_step(w, avg, None, lr=1.0, beta=0.0)  # beta 0, lr 1: FedAvg
    assert np.allclose(plain["a"], avg["a"])


def _profile() -> dict:
    spec = {"family": "cnn", "depth": "shallow", "width": 0.5, "in_channels": 1, "num_classes": 2}
    return {s: {"model": dict(spec), "input_size": 32} for s in ("site-1", "site-2")}


def test_the_catalogue_entry_is_all_the_platform_needs():
    from nvflare_jobs.jobs import build_job, make_controller

    assert "fedavg_momentum" in catalogue.CATALOGUE and not catalogue.is_prototype("fedavg_momentum")
    ctl = make_controller("fedavg_momentum", _profile(), {"rounds": 2, "momentum": "0.5", "seed": 3})
    assert isinstance(ctl, MomentumFedAvgController)
    assert (ctl.momentum, ctl.server_lr, ctl.num_rounds, ctl.seed) == (0.5, 1.0, 2, 3)
    assert ctl.check_options() == {"server_lr": 1.0, "momentum": 0.5}
    with pytest.raises(catalogue.OptionError, match=r"fedavg_momentum: option 'momentum'.*\[0, 1\), got 1.5"):
        make_controller("fedavg_momentum", _profile(), {"momentum": 1.5})
    assert build_job("fedavg_momentum", _profile(), {"rounds": 1}).name == "cxr_hfl_fedavg_momentum"


def run_in_simulator(profile_dir: str, workspace: str) -> int:
    """Build the toy method's job and run it in the NVFlare simulator (called in a fresh process)."""
    from nvflare_jobs.jobs import build_job
    from nvflare_jobs.proctree import unique_simulator_ports
    from hfl_components.flare.site_config import ENV_DIR, load_profile

    os.environ[ENV_DIR] = profile_dir
    unique_simulator_ports()
    profile = load_profile(profile_dir)
    job = build_job("fedavg_momentum", profile, {"rounds": 2, "momentum": 0.5, "seed": 0})
    return job.simulator_run(workspace, threads=len(profile), log_config="concise")


@pytest.mark.slow
def test_toy_method_runs_in_the_simulator(tmp_path, data_root):
    sites = ["site-1", "site-2"]
    man = tiny_manifests(data_root, tmp_path / "manifests", sites, n_train=8, n_val=4, n_test=4)
    profile = tiny_profile(man, tmp_path / "profile", "fedavg", input_size=32)
    ws = tmp_path / "ws"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    t0 = time.time()
    r = subprocess.run([sys.executable, "-c", "import sys; from tests.test_toy_method import run_in_simulator; "
                        f"sys.exit(run_in_simulator({str(profile)!r}, {str(ws)!r}) or 0)"],
                       cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    hits = sorted(ws.rglob("cxr_hfl_results/server_results.json"))
    assert hits, f"no server results after {time.time() - t0:.0f} s (rc {r.returncode}): {r.stderr[-3000:]}"
    rec = json.loads(hits[-1].read_text())
    assert "failed" not in rec, rec.get("failed")
    assert rec["method"] == "fedavg_momentum" and rec["task_config"] == {}
    assert [x["task"] for x in rec["rounds"]] == ["fedavg_train", "fedavg_train", "evaluate"]
    assert sorted(rec["sites"]) == sites and all(rec["sites"][s]["test"]["n"] == 4 for s in sites)
    assert len(rec["server_step_norm"]) == 2 and all(n > 0 for n in rec["server_step_norm"])
    assert not rec["excluded"]
    from hfl_components.models import read_model_header

    header = read_model_header(hits[-1].parent / "global_model.pt")
    assert header["provenance"]["method"] == "fedavg_momentum"


def test_exported_job_asks_sites_for_their_next_task_every_half_second(tmp_path):
    """The server's task_request_interval (NVFlare default 2 s, the wait before a site's next task request) is
    written into the exported server config, where NVFlare's server reads it (it bounds the latency of a round's start)."""
    import json

    from nvflare_jobs.jobs import TASK_REQUEST_INTERVAL_S, build_job

    job = build_job("fedavg_momentum", _profile(), {"rounds": 1})
    job.export_job(str(tmp_path))
    cfg = json.loads(next(tmp_path.rglob("config_fed_server.json")).read_text())
    assert cfg["server"] == {"task_request_interval": 0.5} == {"task_request_interval": TASK_REQUEST_INTERVAL_S}
    assert [w["path"].rsplit(".", 1)[-1] for w in cfg["workflows"]] == ["MomentumFedAvgController"]
