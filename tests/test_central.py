"""The pooled-data reference ``central``: the union of the sites' training images (pure functions and a known-answer
in-process federation: the training site's pooled manifest is exactly the union of what every site's runtime trains
on, every site deploys the one pooled model at its input size), and a compare run with FedAvg that reports its gap."""
from __future__ import annotations

import csv
import numpy as np
import pytest

from hfl_components.central import pool_rows, rows_digest, trainer_site


def test_pool_rows_is_the_union_in_site_order_and_refuses_an_image_of_two_sites():
    rows = pool_rows({"b": [{"path": "/x/1.png", "label": 1}], "a": [{"path": "/x/2.png", "label": 0},
                                                                     {"path": "/x/3.png", "label": 1}]})
    assert rows == [{"path": "/x/1.png", "label": 1, "site": "b"}, {"path": "/x/2.png", "label": 0, "site": "a"},
                    {"path": "/x/3.png", "label": 1, "site": "a"}]
    with pytest.raises(ValueError, match="image /x/1.png is listed by site b and site a"):
        pool_rows({"b": [{"path": "/x/1.png", "label": 1}], "a": [{"path": "/x/1.png", "label": 1}]})
    with pytest.raises(ValueError, match="site a: a training row without a path"):
        pool_rows({"a": [{"label": 1}]})


def test_rows_digest_is_order_free_and_sees_a_label_or_an_image_change():
    a = [{"path": "p1", "label": 0}, {"path": "p2", "label": 1}]
    assert rows_digest(a) == rows_digest(a[::-1])
    assert rows_digest(a) != rows_digest([{"path": "p1", "label": 1}, {"path": "p2", "label": 1}])
    assert rows_digest(a) != rows_digest(a[:1])


def test_trainer_is_the_first_site_holding_the_deepest_spec():
    deep, shallow = {"family": "cnn", "depth": "deep"}, {"family": "cnn", "depth": "shallow"}
    assert trainer_site({"site-3": deep, "site-1": shallow, "site-2": deep}, deep) == "site-2"
    assert trainer_site({"site-2": shallow, "site-1": shallow}, deep) == "site-1"
    with pytest.raises(ValueError):
        trainer_site({}, deep)


def test_central_in_process_trains_once_on_the_union_and_every_site_deploys_it(tmp_path):
    """Three SiteRuntimes (16 px sites, one capped at 6 training images): the tasks in order; the training site's
    pooled manifest lists exactly the union of the three runtimes' training rows (the cap applied); every site
    deploys the same weights at 24 px and is scored there; each site's upload is its image files' bytes (the training
    site adds the model once), each download the model once."""
    from hfl_components.flare.inprocess import InProcessTransport, runtime_answer
    from hfl_components.flare.site_tasks import SiteRuntime
    from hfl_components.models import build_model, load_model_file
    from nvflare_jobs.jobs import make_controller
    from tests.test_inprocess import _site

    deep = {"family": "cnn", "depth": "shallow", "width": 1.0, "in_channels": 1, "num_classes": 2}
    profile = {"site-1": _site(tmp_path, "site-1", 24), "site-2": {**_site(tmp_path, "site-2", 28), "model": deep},
               "site-3": {**_site(tmp_path, "site-3", 30), "max_train_images": 6}}
    runtimes = {s: SiteRuntime(cfg, tmp_path / "ws" / s) for s, cfg in profile.items()}
    ctl = make_controller("central", profile, {"local_epochs": 1, "seed": 0, "central_input_size": 24})
    assert ctl.min_sites == 3 and ctl.global_spec == deep
    t = InProcessTransport(runtimes, runtime_answer(runtimes, raise_errors=True))
    t.attach(ctl, tmp_path / "server", info=lambda m: None, warning=lambda m: None)
    ctl.run()
    assert [(c[0], c[1]) for c in t.sent] == [("central_share", 0), ("central_train", 1), ("central_install", 2),
                                              ("evaluate", 2)]
    union = {(r["path"], r["label"]) for rt in runtimes.values() for r in rt.rows("train")}
    assert len(runtimes["site-3"].rows("train")) == 6
    with (tmp_path / "ws" / "site-2" / "cxr_hfl_state" / "central_pool" / "pooled_train.csv").open() as fh:
        pooled = [(r["path"], int(r["label"])) for r in csv.DictReader(fh)]
    assert len(pooled) == len(union) and set(pooled) == union  # site-2 holds the deepest spec: it trains
    rec = ctl.record["central"]
    assert rec["trainer"] == "site-2" and rec["n_train"] == len(union) and rec["trained_on_pool"] is True
    assert {s: v["n_train"] for s, v in rec["sites"].items()} == {s: len(rt.rows("train")) for s, rt in runtimes.items()}
    glob, header = load_model_file(tmp_path / "server" / "cxr_hfl_results" / "global_model.pt")
    assert header["input_size"] == 24 and header["spec"] == deep
    for s, rt in runtimes.items():
        dep, h = load_model_file(rt.state_dir / "deployed_model.pt")
        assert h["input_size"] == 24 and all(np.array_equal(v.numpy(), glob.state_dict()[k].numpy())
                                             for k, v in dep.state_dict().items())
        assert ctl.record["sites"][s]["input_size"] == 24 and ctl.record["sites"][s]["test"]["n"] >= 1
    # bytes per site: the image files up (the training site: plus the model once), the model down once
    import os

    from hfl_components.communication import bytes_per_site

    model_bytes = sum(4 * v.numel() for v in build_model(deep).state_dict().values())
    per_site = bytes_per_site(ctl.record["rounds"])
    for s, rt in runtimes.items():
        files = sum(os.path.getsize(r["path"]) for r in rt.rows("train"))
        assert per_site[s] == {"up": files + (model_bytes if s == "site-2" else 0), "down": model_bytes}
    assert sum(d["up"] for d in per_site.values()) == ctl.record["bytes_uploaded"]
