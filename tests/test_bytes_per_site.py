"""Bytes per site (``hfl_components.communication``): hand-computed cases over the run record's per-task entries,
FENS's peer-to-peer share (every site receives every other site's model) in a known-answer in-process federation,
and the per-site values where a reader finds them: ``metrics.json``, compare's table and the model card."""
from __future__ import annotations

import pytest

from hfl_components.communication import bytes_per_site, peer_share, site_totals

ROUNDS = [  # two tasks: both sites answer the first (10 / 20 bytes up, 5 down each), only s1 the second
    {"task": "a", "bytes_up_per_site": {"s2": 20, "s1": 10}, "bytes_down_per_site": 5},
    {"task": "b", "bytes_up_per_site": {"s1": 1}, "bytes_down_per_site": 7},
]


def test_bytes_per_site_by_hand():
    per = bytes_per_site(ROUNDS)
    assert per == {"s1": {"up": 11, "down": 12}, "s2": {"up": 20, "down": 5}}
    assert list(per) == ["s1", "s2"]
    # the per-site values add up to the run's totals as the controller counts them (message bytes x answers)
    assert sum(d["up"] for d in per.values()) == 10 + 20 + 1
    assert sum(d["down"] for d in per.values()) == 5 * 2 + 7 * 1
    assert bytes_per_site([]) == {} and bytes_per_site([{"task": "x"}]) == {}
    with pytest.raises(ValueError, match="site s1"):
        bytes_per_site([{"task": "x", "bytes_up_per_site": {"s1": -1}, "bytes_down_per_site": 0}])


def test_peer_share_by_hand():
    assert peer_share({"a": 100, "b": 200, "c": 300}) == {"a": 500, "b": 400, "c": 300}
    assert peer_share({"only": 64}) == {"only": 0}  # one site: no peers
    per = bytes_per_site(ROUNDS, peer_models={"s1": 3, "s2": 4})
    assert per["s1"]["peer_models_down"] == 4 and per["s2"]["peer_models_down"] == 3
    with pytest.raises(ValueError, match="site b"):
        peer_share({"a": 1, "b": -2})


def test_site_totals_by_hand():
    t = site_totals({"s1": {"up": 11, "down": 12}, "s2": {"up": 20, "down": 5}})
    assert t == {"up_mean": 15.5, "up_max": 20, "down_mean": 8.5, "down_max": 12}
    assert site_totals({}) == {}


def test_fens_in_process_each_site_receives_every_other_sites_model(tmp_path):
    """Two sites of different widths: each site's peers' models are exactly the other site's model bytes (4 bytes per
    float32 weight of its spec), and the per-site values add up to the run's totals."""
    from hfl_components.flare.inprocess import InProcessTransport, runtime_answer
    from hfl_components.flare.site_tasks import SiteRuntime
    from hfl_components.models import build_model
    from nvflare_jobs.jobs import make_controller
    from tests.test_inprocess import _site

    wide = {"family": "cnn", "depth": "shallow", "width": 1.0, "in_channels": 1, "num_classes": 2}
    profile = {"site-1": _site(tmp_path, "site-1", 20), "site-2": {**_site(tmp_path, "site-2", 20), "model": wide}}
    runtimes = {s: SiteRuntime(cfg, tmp_path / "ws" / s) for s, cfg in profile.items()}
    ctl = make_controller("fens", profile, {"rounds": 1, "local_epochs": 1, "seed": 0, "fens_holdout": 0.3,
                                            "fens_epochs": 1})
    InProcessTransport(runtimes, runtime_answer(runtimes, raise_errors=True)).attach(
        ctl, tmp_path / "server", info=lambda m: None, warning=lambda m: None)
    ctl.run()
    size = {s: sum(4 * v.numel() for v in build_model(cfg["model"]).state_dict().values())
            for s, cfg in profile.items()}
    assert size["site-1"] != size["site-2"]
    per = bytes_per_site(ctl.record["rounds"], ctl.record["peer_model_bytes"])
    assert per["site-1"]["peer_models_down"] == size["site-2"] and per["site-2"]["peer_models_down"] == size["site-1"]
    assert sum(d["up"] for d in per.values()) == ctl.record["bytes_uploaded"]
    assert sum(d["down"] for d in per.values()) == ctl.record["bytes_downloaded"]
    # each site downloads both models once, then the aggregator (payload record of the controller)
    assert all(d["down"] == ctl.record["payload"]["down_per_site"]["total"] for d in per.values())


def _metrics(method, bytes_per_site_, auc):
    return {"method": method, "labels": "binary", "bytes_uploaded": 1, "bytes_downloaded": 2,
            "bytes_per_site": bytes_per_site_,
            "sites": {s: {"model": {"family": "cnn", "depth": "shallow"}, "input_size": 32, "n_test": 4,
                          "test": {"accuracy": a, "balanced_accuracy": a, "auc": a}} for s, a in auc.items()}}


def test_compare_table_and_model_card_show_bytes_per_site(tmp_path):
    from nvflare_jobs.compare import comparison_markdown, comparison_rows
    from nvflare_jobs.report import model_card

    fens = _metrics("fens", {"site-1": {"up": 100, "down": 300, "peer_models_down": 200},
                             "site-2": {"up": 300, "down": 500, "peer_models_down": 100}}, {"site-1": .7, "site-2": .8})
    fedavg = _metrics("fedavg", {"site-1": {"up": 40, "down": 40}, "site-2": {"up": 40, "down": 40}},
                      {"site-1": .6, "site-2": .7})
    runs = [("fedavg", 0, fedavg), ("fens", 0, fens)]
    rows = comparison_rows(runs, thresholds=False)
    r = next(x for x in rows if x["method"] == "fens" and x["site"] == "site-2")
    assert (r["site_bytes_up"], r["site_bytes_down"], r["site_peer_models_down"]) == (300, 500, 100)
    md = comparison_markdown(tmp_path, runs, rows, plans={})
    # fens: up mean 200, largest 300; down mean 400, largest 500; peers mean 150 = 300 of 800 bytes down (38%)
    assert "| fens | 200 | 300 | 400 | 500 | 150 | 38% |" in md
    assert "| fedavg | 40 | 40 | 40 | 40 | – | – |" in md
    card = model_card(fens)
    assert "<th>bytes up</th><th>bytes down</th>" in card.replace("\n", "")
    assert "site-1 200, site-2 100 bytes" in card
    assert "Peer-to-peer" not in model_card(fedavg)
