"""Fusion ladder rung 0: a model fused with a permuted copy of itself, through the *whole* server path
(OHFL controller, probe, CID aggregation, balancing, OT, repair, ``global_model.pt`` save, the site's reload of the
broadcast weights at its own input size) gives back the parent's predictions on real chest X-rays."""
from __future__ import annotations

from tests.fusion_helpers import ohfl_controller

import numpy as np
import pytest
import torch

from tests.fusion_helpers import he_model
from tests.test_fusion_ot import permuted_copy

torch.set_num_threads(1)


def _fl(params, meta, metrics=None):
    from nvflare.app_common.abstract.fl_model import FLModel

    return FLModel(params=params, meta=meta, metrics=metrics or {})


def _images(data_root, size, n=24):
    from chest_xray import build_transforms
    from chest_xray.splits import split_files, split_rows

    rows = split_rows("tuning")
    files = split_files("tuning", data_root / "chest_xray_224")
    picks = list(range(0, len(files), len(files) // n))[:n]
    tf = build_transforms(size, "eval")
    x = torch.stack([torch.as_tensor(tf({"image": str(files[i]), "label": 0})["image"]).float() for i in picks])
    y = np.array([0 if rows[i]["label"].upper() == "NORMAL" else 1 for i in picks])
    return x, y


def run_server(monkeypatch, tmp_path, uploads: dict, probe: str, **ctl_kw):
    """Run OHFLController.run_method with the sites' answers faked; returns (controller, broadcast global params)."""

    ctl = ohfl_controller(probe=probe, min_sites=1, probe_size=16, **ctl_kw)
    monkeypatch.setattr(ctl, "get_run_dir", lambda: str(tmp_path))
    sent = {}

    def fake_send(task_name, data, **kw):
        sent[task_name] = data
        if task_name == "ohfl_train":
            return [_fl(sd, {"status": "ok", "spec": spec, "n_train": 10, "val_acc": 0.5, "input_size": size,
                             "client_name": name}) for name, (spec, sd, size) in uploads.items()]
        return [_fl({}, {"status": "ok", "client_name": name}) for name in uploads]

    monkeypatch.setattr(ctl, "send_model_and_wait", fake_send)
    ctl.run_method()
    return ctl, sent["ohfl_finetune"]


@pytest.mark.parametrize("options,copy_size", [
    ({}, 64),  # today's defaults (acts, channel repair, probe at each model's own size): the copy at the same size
    ({"probe_at": "largest"}, 128),
    ({"probe_at": "largest", "repair": "layer"}, 128),
    ({"probe_at": "largest", "repair": "none", "ground_metric": "acts"}, 128),
    ({"probe_at": "largest", "repair": "channel", "cka": "debiased"}, 128),
    ({"probe_at": "largest", "ground_metric": "wts", "repair": "layer"}, 128)])
def test_rung0_permuted_copy_through_the_server_reproduces_the_parent(monkeypatch, tmp_path, data_root, options,
                                                                     copy_size):
    """The defaults with the copy uploaded at the parent's size; the largest-size probe with the copy at another
    size, under each repair mode and both ground metrics. (With ``probe_at="own"`` a copy uploaded at another size
    is probed on other-resolution images, so it is not the same function of its probe and rung 0 is not exact
    there by construction.)"""
    from hfl_components.flare.messages import GLOBAL_PREFIX, from_numpy_state, to_numpy_state
    from hfl_components.models import build_model
    from nvflare_jobs.evaluation import load_model_file

    spec = {"family": "cnn", "depth": "deep", "width": 0.25, "in_channels": 1, "num_classes": 2}
    parent = he_model(spec, 0, bias_range=0.2)
    sd = parent.state_dict()
    uploads = {"site-1": (spec, to_numpy_state(sd), 64), "site-2": (spec, to_numpy_state(permuted_copy(spec, sd, 3)),
                                                                     copy_size)}
    # fusion alone (distill_steps=0): the distillation stage after fusion moves the global model towards the
    # uploads' ensemble, whose members see the probe at their own sizes, so it is not rung 0's exact function
    ctl, sent = run_server(monkeypatch, tmp_path, uploads, str(data_root / "chest_xray_224"), distill_steps=0,
                           **options)
    # the site's view: global weights from the broadcast, rebuilt from the spec in meta (SiteRuntime.set_model)
    site_model = build_model(sent.meta["global_spec"])
    site_model.load_state_dict(from_numpy_state(sent.params, GLOBAL_PREFIX))
    saved, _ = load_model_file(tmp_path / "cxr_hfl_results" / "global_model.pt")
    # the probe came from the committed probe part only
    from chest_xray.splits import split_rows

    probe_names = {r["path"].rsplit("/", 1)[-1] for r in split_rows("probe")}
    assert ctl.record["probe"]["files"] and set(ctl.record["probe"]["files"]) <= probe_names
    parent.eval()
    site_model.eval()
    for size in (64, 96, 128):
        x, _ = _images(data_root, size)
        with torch.no_grad():
            ref = torch.softmax(parent(x), 1)
            for m in (site_model, saved):
                assert (torch.softmax(m(x), 1) - ref).abs().max() < 1e-4, size
