"""The one in-process federation (``hfl_components.flare.inprocess``): a real controller and the real site handlers on
SiteRuntimes, no simulator. Known answers: the saved global model is the sample-weighted average of the last round's
uploads (computed here from what the sites sent); the handlers get the site script's meta (round, total_rounds); a
site whose task fails is answered as the site script answers it and left out by name."""
from __future__ import annotations

import numpy as np
import pytest
from nvflare.app_common.abstract.fl_model import FLModel

from hfl_components.flare.inprocess import InProcessTransport, runtime_answer, task_meta
from tests.synthetic_sites import first_four_cover, synthetic_site


def _site(tmp_path, name, n):
    """A site of ``n`` small images; a 4-image site has each split."""
    return synthetic_site(tmp_path, name, n, first_four_cover)


def test_task_meta_is_the_site_scripts():
    m = task_meta(FLModel(params={}, meta={"method": "fedavg"}, current_round=2, total_rounds=5))
    assert m == {"method": "fedavg", "round": 2, "total_rounds": 5}


@pytest.mark.parametrize("method", ["fedavg", "fedprox"])
def test_federation_in_process_global_model_is_the_weighted_average(tmp_path, method):
    from hfl_components.flare.site_tasks import SiteRuntime
    from hfl_components.models import load_model_file
    from nvflare_jobs.jobs import make_controller

    profile = {"site-1": _site(tmp_path, "site-1", 12), "site-2": _site(tmp_path, "site-2", 8)}
    runtimes = {s: SiteRuntime(cfg, tmp_path / "ws" / s) for s, cfg in profile.items()}
    real = runtime_answer(runtimes)
    seen = []

    def answer(task, site, data):
        out = real(task, site, data)
        seen.append((task, site, data.current_round, out))
        return out

    ctl = make_controller(method, profile, {"rounds": 2, "local_epochs": 1, "seed": 0})
    t = InProcessTransport(runtimes, answer)
    t.attach(ctl, tmp_path / "server", info=lambda m: None, warning=lambda m: None)
    ctl.run()
    assert [c["task"] for c in t.calls] == [f"{method}_train"] * 2 + ["evaluate"]
    last = [(site, o) for task, site, rnd, o in seen if task != "evaluate" and rnd == 1]
    n = {site: o[2]["NUM_STEPS_CURRENT_ROUND"] for site, o in last}
    assert n == {"site-1": 6, "site-2": 4}  # each site's training images
    want = {k: sum(n[s] * o[0][k] for s, o in last) / sum(n.values()) for k in last[0][1][0]}
    glob, _ = load_model_file(tmp_path / "server" / "cxr_hfl_results" / "global_model.pt")
    for k, v in glob.state_dict().items():
        if np.issubdtype(want[k].dtype, np.floating):
            np.testing.assert_allclose(v.numpy(), want[k], rtol=1e-5, atol=1e-6)
    assert set(ctl.record["sites"]) == {"site-1", "site-2"} and not ctl.record["excluded"]


def test_a_failing_site_is_answered_as_the_site_script_does_and_left_out(tmp_path):
    from hfl_components.flare.site_tasks import SiteRuntime
    from nvflare_jobs.jobs import make_controller

    good = _site(tmp_path, "site-1", 8)
    bad = dict(_site(tmp_path, "site-2", 8), data={"labels": "binary", "manifest": str(tmp_path / "missing.csv")})
    profile = {"site-1": good, "site-2": bad}
    runtimes = {s: SiteRuntime(cfg, tmp_path / "ws" / s) for s, cfg in profile.items()}
    ctl = make_controller("local", profile, {"rounds": 1, "local_epochs": 1, "min_sites": 1})
    InProcessTransport(runtimes, runtime_answer(runtimes)).attach(ctl, tmp_path / "server", info=lambda m: None,
                                                                  warning=lambda m: None)
    ctl.run()
    reason = ctl.record["excluded"]["site-2"][0]["reason"]
    assert reason.startswith("site site-2: task local_train failed: ") and "missing.csv" in reason
    assert set(ctl.record["sites"]) == {"site-1"}
    with pytest.raises(Exception):
        runtime_answer(runtimes, raise_errors=True)("local_train", "site-2", FLModel(params={}, meta={}))
