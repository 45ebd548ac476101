"""OHFL's probe prepared in the background as the sites' uploads arrive: the server fuses with the same
probe tensors a synchronous load gives, each size is loaded once, a loader error surfaces, and answers of other
tasks or failed sites start nothing."""
from __future__ import annotations

from tests.fusion_helpers import ohfl_controller

import pytest
import torch

from tests.fusion_helpers import he_model

torch.set_num_threads(1)


def _fl(params, meta):
    from nvflare.app_common.abstract.fl_model import FLModel

    return FLModel(params=params, meta=meta, metrics={})


def _uploads():
    from hfl_components.flare.messages import to_numpy_state

    out = {}
    for k, (depth, size) in enumerate([("shallow", 32), ("deep", 64), ("deep", 64)]):
        spec = {"family": "cnn", "depth": depth, "width": 0.25, "in_channels": 1, "num_classes": 2}
        out[f"site-{k + 1}"] = (spec, to_numpy_state(he_model(spec, k, bias_range=0.2).state_dict()), size)
    return out


def _meta(name, spec, size, status="ok"):
    return {"status": status, "spec": spec, "n_train": 10, "val_acc": 0.5, "input_size": size, "client_name": name}


def test_probe_preloaded_during_round0_is_the_synchronous_probe(monkeypatch, tmp_path):
    import hfl_components.fusion as fusion
    from hfl_components.flare.probe import load_probe

    ctl = ohfl_controller(probe="generated", min_sites=1, probe_size=8, seed=3)
    monkeypatch.setattr(ctl, "get_run_dir", lambda: str(tmp_path))
    calls: list = []
    orig = ctl._load_probe

    def counting(size):
        calls.append(size)
        return orig(size)
    monkeypatch.setattr(ctl, "_load_probe", counting)
    ups = _uploads()
    # answers as NVFlare delivers them during round 0: another task and a failed site start nothing
    ctl.on_site_result("evaluate", _fl({}, _meta("site-9", None, 96)))
    ctl.on_site_result("ohfl_train", _fl({}, _meta("site-8", None, 128, status="error")))
    for name, (spec, sd, size) in ups.items():
        ctl.on_site_result("ohfl_train", _fl(sd, _meta(name, spec, size)))
    seen = {}
    real = fusion.aggregate_models

    def spy(models, **kw):
        seen["probe"] = kw["probe"]
        return real(models, **kw)
    monkeypatch.setattr(fusion, "aggregate_models", spy)

    def fake_send(task_name, data, **kw):
        if task_name == "ohfl_train":
            return [_fl(sd, _meta(name, spec, size)) for name, (spec, sd, size) in ups.items()]
        return [_fl({}, {"status": "ok", "client_name": name}) for name in ups]
    monkeypatch.setattr(ctl, "send_model_and_wait", fake_send)
    ctl.run_method()
    assert sorted(calls) == [32, 64]  # one load per size, none for the other task / the failed site
    assert sorted(seen["probe"]) == [32, 64]
    for size, x in seen["probe"].items():
        assert torch.equal(x, load_probe("generated", size, 8, seed=3))
    sec = ctl.record["server_seconds"]
    assert sec["probe"] > 0 and 0 <= sec["probe_wait"]
    assert ctl.record["probe"]["sizes"] == [32, 64]


def test_probe_preloader_error_surfaces_when_the_probe_is_needed():
    from hfl_components.flare.controllers._probe_preload import ProbePreloader

    def bad(size):
        raise FileNotFoundError(f"no probe at {size}")
    pre = ProbePreloader(bad)
    pre.start(64)
    with pytest.raises(FileNotFoundError, match="no probe at 64"):
        pre.get(64)
    pre.close()
