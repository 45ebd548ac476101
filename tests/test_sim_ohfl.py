"""OHFL as a federation: one simulator run with three depths on real images, and the server's upload checks."""
from __future__ import annotations

from tests.fusion_helpers import ohfl_controller

import json

import numpy as np
import pytest
import torch

from tests.sim_helpers import assert_canonical, load_metrics, make_partition, make_profile, run_cli

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def partition3(data_root, tmp_path_factory):
    return make_partition(data_root, tmp_path_factory.mktemp("p3"), 3)


@pytest.mark.slow
def test_ohfl_three_depths_in_simulator(partition3, data_root, tmp_path):
    profile = make_profile(partition3, tmp_path / "profile", "ohfl")
    run = tmp_path / "run"
    r = run_cli("simulate", "--method", "ohfl", "--profile", str(profile), "--probe",
                str(data_root / "chest_xray_224"), "--probe-size", "24", "--out", str(run))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = load_metrics(run)
    sites = ["site-1", "site-2", "site-3"]
    assert_canonical(m, sites)
    depths = [json.loads((run / "resolved_configs" / f"{s}.json").read_text())["model"]["depth"] for s in sites]
    assert depths == ["shallow", "medium", "deep"]
    # CID: the global model has the deepest architecture; every site fine-tunes it and deploys it when it passes the
    # site acceptance check (the gate, on by default); a refused site keeps its local model when that passes the same
    # check, and otherwise deploys nothing (the file keeps the federated weights, with no threshold and the reason)
    assert m["global_model"]["depth"] == "deep"
    assert m["gate"]["sites"] == 3 and m["gate"]["adopted"] == len(m["gate"]["adopted_sites"])
    from hfl_components.models import read_model_header

    for s, own in zip(sites, depths):
        b = m["sites"][s]
        assert b["gate"]["adopted"] is (s in m["gate"]["adopted_sites"])
        assert b["gate"]["adopted"] is (b["gate"]["deployed"] == "federated")
        assert b["model"]["depth"] == (own if b["gate"]["deployed"] == "local" else "deep")
        if b["gate"]["deployed"] is None:
            assert read_model_header(run / "models" / f"{s}_deployed.pt")["operating_point"]["threshold"] is None
        assert {"local", "global_zero_shot"} <= set(b) and len(b["finetune_loss"]) == 1
        assert b["local"]["n"] == b["global_zero_shot"]["n"] == b["n_test"]
    accs = [100 * m["sites"][s]["test"]["accuracy"] for s in sites]
    assert m["fairness_variance"] == pytest.approx(np.var(accs, ddof=1))
    assert set(m["server_fusion_s"]) >= {"cka", "alignment", "ot", "averaging"}
    # one-shot: each site uploads its own model once; the global model goes down once
    from hfl_components.models import build_model

    def n_bytes(spec):
        return 4 * sum(p.numel() for p in build_model(spec).state_dict().values())

    local_specs = [json.loads((run / "resolved_configs" / f"{s}.json").read_text())["model"] for s in sites]
    up = sum(n_bytes(spec) for spec in local_specs)
    down = 3 * n_bytes(m["global_model"])
    assert m["bytes_uploaded"] == up and m["bytes_downloaded"] == down
    rec = json.loads((run / "alignment_record.json").read_text())
    assert rec["strategy"] == "cid" and len(rec["pairs"]) == 2
    assert (run / "global_model.pt").is_file() and (run / "cka_cost_step1.png").is_file()
    assert (run / "finetune_loss.png").is_file()


def _fl_model(params, meta):
    from nvflare.app_common.abstract.fl_model import FLModel

    return FLModel(params=params, meta=meta)


def test_ohfl_server_rejects_nan_and_shape_mismatched_uploads_and_continues(monkeypatch):
    """A NaN upload and a shape-mismatched upload are excluded by name; the round goes on with the good one."""
    from hfl_components.flare.messages import to_numpy_state
    from hfl_components.models import build_model

    spec = {"family": "cnn", "depth": "shallow", "width": 0.25, "in_channels": 1, "num_classes": 2}
    good = to_numpy_state(build_model(spec).state_dict())
    nan = {k: v.copy() for k, v in good.items()}
    nan["fcs.0.weight"][0, 0] = np.nan
    wrong = {k: v.copy() for k, v in good.items()}
    wrong["convs.1.weight"] = wrong["convs.1.weight"][:, :1]
    results = [_fl_model(p, {"status": "ok", "spec": spec, "n_train": 10, "client_name": name})
               for name, p in (("site-a", good), ("site-b", nan), ("site-c", wrong))]
    results.append(_fl_model({}, {"status": "error", "error": "site site-d: task failed: boom", "client_name": "site-d"}))
    ctl = ohfl_controller(probe="generated", min_sites=1)
    monkeypatch.setattr(ctl, "send_model_and_wait", lambda **kw: results)
    ok = ctl.broadcast("ohfl_train", 0)
    assert list(ok) == ["site-a"]
    ex = ctl.record["excluded"]
    assert "non-finite" in ex["site-b"][0]["reason"] or "nan" in ex["site-b"][0]["reason"].lower()
    assert "shape" in ex["site-c"][0]["reason"]
    assert "boom" in ex["site-d"][0]["reason"]
    assert ctl.record["bytes_uploaded"] == 3 * sum(v.nbytes for v in good.values()) - 4 * (
        good["convs.1.weight"].size - wrong["convs.1.weight"].size)
    ctl2 = ohfl_controller(probe="generated", min_sites=2)
    monkeypatch.setattr(ctl2, "send_model_and_wait", lambda **kw: results)
    with pytest.raises(RuntimeError, match="only 1 usable"):
        ctl2.broadcast("ohfl_train", 0)
