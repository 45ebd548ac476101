"""FedProx (Li et al., 2020, arXiv:1812.06127) as a baseline: its pure proximal term, its site handler and its
catalogue row (the server is FedAvgController with its own task name). Known answers: the hand-computed penalty and
gradient; gradient descent on a quadratic converges to the closed-form minimiser of F + mu/2 ||w - w^t||^2; mu = 0
trains exactly as FedAvg's handler; a large mu keeps the upload near the global model."""
from __future__ import annotations

import csv

import numpy as np
import pytest
import torch

from hfl_components.flare import catalogue
from hfl_components.training.proximal import ProximalTerm, proximal_penalty


def test_penalty_and_gradient_by_hand():
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    loss = proximal_penalty([w], [torch.zeros(2)], mu=0.5)
    assert float(loss.detach()) == pytest.approx(0.25 * 5.0)  # mu/2 * (1 + 4)
    loss.backward()
    assert torch.allclose(w.grad, torch.tensor([0.5, 1.0]))  # mu * (w - w^t)
    with pytest.raises(ValueError, match="mu"):
        proximal_penalty([w], [torch.zeros(2)], mu=-1.0)
    with pytest.raises(ValueError, match="shape"):
        proximal_penalty([w], [torch.zeros(3)], mu=1.0)


def test_gradient_descent_reaches_the_closed_form_minimiser():
    """min_w 1/2 ||w - c||^2 + mu/2 ||w - w0||^2 has w* = (c + mu w0) / (1 + mu)."""
    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.5, -1.0, 2.0]]))
    w0 = model.weight.detach().clone()
    c = torch.tensor([[2.0, 1.0, -1.0]])
    mu = 3.0
    prox = ProximalTerm(model, mu)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(300):
        opt.zero_grad()
        loss = 0.5 * (model.weight - c).pow(2).sum() + prox(None, None, None)
        loss.backward()
        opt.step()
    assert torch.allclose(model.weight.detach(), (c + mu * w0) / (1 + mu), atol=1e-5)
    assert prox.last["proximal"] > 0


def _runtime(tmp_path, name):
    from PIL import Image

    from hfl_components.flare.site_tasks import SiteRuntime

    rng = np.random.default_rng(0)
    man = tmp_path / f"{name}.csv"
    with man.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["path", "label", "split", "patient_id"])
        for k in range(8):
            f = tmp_path / f"{name}{k}.png"
            Image.fromarray((rng.random((20, 20)) * 150 + 60 + 40 * (k % 2)).astype(np.uint8)).save(f)
            w.writerow([str(f), k % 2, "train", f"p{k}"])
    cfg = {"site": "site-1", "threads": 1, "seed": 0, "input_size": 16, "batch_size": 4, "augment_classes": [],
           "augment": "batch", "lr": 0.05, "momentum": 0.9, "class_weights": None, "local_epochs": 3,
           "data": {"labels": "binary", "manifest": str(man)},
           "model": {"family": "cnn", "depth": "shallow", "width": 0.5, "in_channels": 1, "num_classes": 2}}
    return SiteRuntime(cfg, tmp_path / f"ws_{name}")


def test_site_handler_mu_zero_is_fedavg_and_large_mu_stays_near_the_global_model(tmp_path):
    from hfl_components.flare.controllers.baselines import fedavg_train
    from hfl_components.flare.messages import GLOBAL_PREFIX, to_numpy_state
    from hfl_components.models import build_model

    spec = {"family": "cnn", "depth": "shallow", "width": 0.5, "in_channels": 1, "num_classes": 2}
    torch.manual_seed(0)
    glob = to_numpy_state(build_model(spec).state_dict())
    params = {GLOBAL_PREFIX + k: v for k, v in glob.items()}
    fedprox_train = catalogue.site_handler("fedprox_train")

    def run(handler, name, **opts):
        meta = {"global_spec": spec, "round": 0, "method": "fedprox", "task_config": {"local_epochs": 3, **opts}}
        up, metrics, meta_out = handler(_runtime(tmp_path, name), dict(params), meta)
        assert meta_out["status"] == "ok" and meta_out["NUM_STEPS_CURRENT_ROUND"] == 8
        return up, metrics

    avg, _ = run(fedavg_train, "avg")
    prox0, m0 = run(fedprox_train, "p0", mu=0.0)
    prox_big, m_big = run(fedprox_train, "pbig", mu=5.0)  # lr * mu < 1: a stable pull
    assert all(np.array_equal(avg[k], prox0[k]) for k in avg)  # mu = 0: FedAvg's local objective, same weights
    assert m0["proximal_last_batch"] == 0.0 and m_big["proximal_last_batch"] > 0

    def drift(up):
        return sum(float(((up[k] - glob[k]) ** 2).sum()) for k in glob if np.issubdtype(glob[k].dtype, np.floating)
                   and "running" not in k)

    assert drift(prox_big) < 0.5 * drift(avg)
    with pytest.raises(ValueError, match="lacks option 'mu'"):  # the handler keeps no default of its own
        run(fedprox_train, "none")


def test_catalogue_row_builds_fedavg_controller_with_the_fedprox_task():
    from hfl_components.flare.controllers.baselines import FedAvgController
    from nvflare_jobs.jobs import build_job, make_controller

    spec = {"family": "cnn", "depth": "shallow", "width": 0.5, "in_channels": 1, "num_classes": 2}
    profile = {s: {"model": dict(spec), "input_size": 32} for s in ("site-1", "site-2")}
    ctl = make_controller("fedprox", profile, {"rounds": 2, "mu": "0.1"})
    assert type(ctl) is FedAvgController and ctl.method == "fedprox" and ctl.task_name == "fedprox_train"
    assert ctl.task_config["mu"] == 0.1 and ctl.check_options() == {"mu": 0.1}
    assert catalogue.entry("fedprox").site_tasks == ("fedprox_train", "evaluate")
    with pytest.raises(catalogue.OptionError, match="fedprox: option 'mu'"):
        make_controller("fedprox", profile, {"mu": -1})
    assert build_job("fedprox", profile, {"rounds": 1}).name == "cxr_hfl_fedprox"
