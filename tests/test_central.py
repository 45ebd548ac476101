"""The pooled-data reference ``central``: the union of the sites' training images (pure functions and a known-answer
in-process federation: the training site's pooled manifest is exactly the union of what every site's runtime trains
on, every site deploys the one pooled model at its input size), and a compare run with FedAvg that reports its gap."""
from __future__ import annotations

import csv
import json

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


def test_the_record_line_says_what_was_pooled_and_flags_another_training_set():
    from hfl_components.central import summarise

    v = {"n_train": 32, "sites": {"site-1": {}, "site-2": {}}, "spec": {"family": "cnn", "depth": "deep"},
         "input_size": 128, "epochs": 1, "trainer": "site-2", "trained_on_pool": True}
    assert summarise(v) == ("32 training images of 2 sites pooled; cnn/deep at 128 px, 1 epoch, trained at site-2; "
                            "trained on exactly the pooled images")
    assert summarise({**v, "trained_on_pool": False}).endswith("TRAINED ON OTHER IMAGES THAN POOLED")


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


def _metrics(method, auc):
    return {"method": method, "labels": "binary",
            "sites": {s: {"model": {"family": "cnn", "depth": "shallow"}, "input_size": 32, "n_test": 4,
                          "test": {"accuracy": a, "balanced_accuracy": a, "auc": a}} for s, a in auc.items()}}


def test_comparison_reports_the_gap_of_every_method_to_central(tmp_path):
    """One seed, two sites: central 0.9 / 0.8, FedAvg 0.7 / 0.75, Local 0.8 / 0.8: gaps +0.125 and +0.050 (central −
    method, mean over the seed's sites); no gap section without central."""
    from nvflare_jobs.compare import comparison_markdown, comparison_rows

    runs = [("central", 0, _metrics("central", {"site-1": .9, "site-2": .8})),
            ("fedavg", 0, _metrics("fedavg", {"site-1": .7, "site-2": .75})),
            ("local", 0, _metrics("local", {"site-1": .8, "site-2": .8}))]
    rows = comparison_rows(runs, thresholds=False)
    md = comparison_markdown(tmp_path, runs, rows, plans={})
    assert "## Gap to the pooled-data reference (central)" in md
    gap = md.split("## Gap to the pooled-data reference (central)")[1].split("\n## ")[0]
    line = {ln.split(" | ")[0].strip("| "): ln for ln in gap.splitlines() if ln.startswith("| ")}
    assert line["fedavg"].startswith("| fedavg | 2 | +0.125") and line["fedavg"].count("+0.125") >= 3
    assert line["local"].startswith("| local | 2 | +0.050")
    assert "central" not in line
    assert "Gap to the pooled" not in comparison_markdown(tmp_path, runs[1:], comparison_rows(runs[1:], False), {})


def test_central_gets_the_common_epoch_budget_in_one_run():
    from nvflare_jobs.compare import CompareOptions, epoch_plan, simulate_options

    a = CompareOptions(out="runs/x", labels="binary")
    assert epoch_plan("central", a) == {"rounds": 1, "local_epochs": 30, "finetune_epochs": 0,
                                        "total_epochs_per_site": 30} == {**epoch_plan("local", a)}
    a = CompareOptions(out="runs/x", labels="binary", local_epochs=3, finetune_epochs=2)
    assert epoch_plan("central", a)["total_epochs_per_site"] == epoch_plan("ohfl", a)["total_epochs_per_site"] == 5
    assert simulate_options("central", "D", 0, a)["local_epochs"] == 5


@pytest.mark.slow
def test_compare_central_and_fedavg_reports_the_gap_and_central_trains_on_the_union(data_root, tmp_path):
    """``compare --methods central,fedavg`` on 2 sites, 1 epoch, 16 training images per site: central's rows and its
    gap to FedAvg are in the tables; central trained on exactly the union of what the two sites' own runtimes train
    on (their resolved configs, the cap applied), at 128 px; bytes per site are in comparison.csv."""
    from hfl_components.flare.site_tasks import SiteRuntime
    from hfl_components.models import read_model_header
    from tests.sim_helpers import run_cli

    out = tmp_path / "cmp"
    r = run_cli("compare", "--methods", "central,fedavg", "--data", str(data_root / "chest_xray_original"),
                "--sites", "2", "--seeds", "0", "--max-images", "120", "--max-train-images", "16", "--local-epochs",
                "1", "--finetune-epochs", "0", "--rounds", "1", "--input-sizes", "32,48", "--late-wait", "60",
                "--out", str(out), timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = list(csv.DictReader((out / "comparison.csv").open()))
    assert {(x["method"], x["site"]) for x in rows} == {(m, s) for m in ("central", "fedavg")
                                                        for s in ("site-1", "site-2")}
    assert all(int(x["site_bytes_up"]) > 0 and int(x["site_bytes_down"]) > 0 for x in rows)
    md = (out / "comparison.md").read_text()
    gap = md.split("## Gap to the pooled-data reference (central)")[1].split("\n## ")[0]
    assert any(ln.startswith("| fedavg | 2 | ") for ln in gap.splitlines())
    run = out / "seed0" / "central"
    m = json.loads((run / "metrics.json").read_text())
    rec = m["central"]
    union = set()
    for site in ("site-1", "site-2"):
        cfg = json.loads((run / "resolved_configs" / f"{site}.json").read_text())
        rt = SiteRuntime(cfg, tmp_path / "check" / site)
        mine = {(r["path"], int(r["label"])) for r in rt.rows("train")}
        assert len(mine) == 16 and rec["sites"][site]["n_train"] == 16
        union |= mine
    with (run / "workspace" / rec["trainer"] / "cxr_hfl_state" / "central_pool" / "pooled_train.csv").open() as fh:
        pooled = [(x["path"], int(x["label"])) for x in csv.DictReader(fh)]
    assert len(pooled) == len(union) == rec["n_train"] == 32 and set(pooled) == union
    assert rec["trained_on_pool"] is True and rec["epochs"] == 1
    assert all(read_model_header(run / "models" / f"{s}_deployed.pt")["input_size"] == 128 for s in ("site-1", "site-2"))


def test_external_tables_pair_central_with_every_method_as_its_gap(tmp_path):
    """External evaluation of central and FENS (one seed, two sites, four shared images): the paired table holds
    "central vs fens (gap to the pooled reference)" with central's AUC 1.0 − FENS's 0.75 = +0.25 (by hand: FENS ranks
    3 of the 4 (pneumonia, normal) pairs right at each site)."""
    from nvflare_jobs.compare.tables import external_tables

    out = tmp_path / "cmp"
    name = "ext"
    (tmp_path / "cmp").mkdir()
    (out / "compare.json").write_text(json.dumps({"external": "EXT", "external_name": name, "methods": []}))
    y = np.array([0, 0, 1, 1])
    score = {"central": np.array([0.1, 0.2, 0.8, 0.9]), "fens": np.array([0.1, 0.6, 0.4, 0.9])}
    runs = []
    for method, p in score.items():
        d = out / "seed0" / method / "external" / name
        d.mkdir(parents=True)
        probs = np.stack([1 - p, p], axis=1)
        np.savez(d / "predictions.npz", paths=np.array(["a", "b", "c", "d"]), y=y,
                 **{f"site-{k}_deployed": probs for k in (1, 2)})
        models = {f"site-{k}_deployed": {"kind": "deployed", "site": f"site-{k}", "input_size": 32, "auc": None}
                  for k in (1, 2)}
        (d / "summary.json").write_text(json.dumps({"models": models, "n_images": 4}))
        runs.append((method, 0, {"_run_dir": str(out / "seed0" / method)}))
    ext = external_tables(out, runs, n_boot=20)
    pair = next(p for p in ext["paired"] if p["comparison"] == "central vs fens (gap to the pooled reference)")
    assert (pair["a"], pair["b"]) == ("central", "fens") and pair["auc"]["diff"] == pytest.approx(0.25)


def test_export_job_refuses_central_in_one_line_and_writes_nothing(tmp_path, capsys):
    """central pools every site's training images: ``export-job --method central`` is refused in one line naming
    the method and pointing to ``compare --methods central``, with or without a profile, and no folder is made;
    the library call (:meth:`RunSpec.export`) refuses it too."""
    from nvflare_jobs.cli import main
    from nvflare_jobs.runner import SimulateError
    from nvflare_jobs.spec import resolve
    from tests.cli_helpers import one_line
    from tests.deploy_helpers import REPO_ROOT

    job = tmp_path / "job"
    for extra in (["--profile", str(REPO_ROOT / "site_configs" / "consortium")], []):
        assert main(["export-job", "--method", "central", *extra, "--out", str(job)]) == 2
        one_line(capsys, "cxr-hfl export-job: method 'central' is the pooled-data reference", "not a federated job",
                 "cxr-hfl compare --methods central")
        assert not job.exists()
    with pytest.raises(SimulateError, match="^method 'central' is the pooled-data reference"):
        resolve("central", {"profile": str(REPO_ROOT / "site_configs" / "consortium")}).export(job)
    assert not job.exists()


def test_a_central_job_folder_is_refused_before_it_is_submitted(tmp_path, capsys):
    """A central job folder built without ``export-job`` (the job builder called directly) is refused by the check
    ``submit`` / ``poc submit`` run first, naming the server config and the method (``cxr-hfl submit``: one line,
    before it opens a session); a FedAvg folder of the same profile passes the same check."""
    from hfl_components.flare.site_config import load_profile
    from nvflare_jobs.cli import main
    from tests.cli_helpers import one_line
    from nvflare_jobs.deploy import DeployError, check_job_folder, export_portable
    from nvflare_jobs.jobs import build_job
    from tests.deploy_helpers import tiny_profile

    man = {s: tmp_path / "data" / f"{s}.csv" for s in ("hospital-a", "hospital-b")}  # not read by the export
    prof = load_profile(tiny_profile(man, tmp_path / "profile", "central"), check_files=False, require_data=False)
    folder = export_portable(build_job("central", prof, {"rounds": 1}), tmp_path / "jobs")
    with pytest.raises(DeployError, match=r"config_fed_server\.json: workflow CentralController: method 'central' "
                                          r"is the pooled-data reference .* cxr-hfl compare --methods central"):
        check_job_folder(folder)
    assert main(["submit", "--job", str(folder), "--startup-kit", str(tmp_path / "kit")]) == 2  # before any session
    one_line(capsys, "cxr-hfl submit: ", "workflow CentralController: method 'central' is the pooled-data reference",
             "nothing was submitted")
    check_job_folder(export_portable(build_job("fedavg", prof, {"rounds": 1}), tmp_path / "jobs"))


def test_model_card_says_central_is_one_pooled_model_of_the_deepest_architecture_not_a_federated_result():
    """The card of a central run names its one model (the deepest spec, cnn/deep), the pooled images of its two
    sites and the one input size it was scored at (32 px, from the sites' blocks), and says it is a reference,
    not deployable; "own architecture" (one model per site) stays the words of a federated run's card."""
    from nvflare_jobs.report import model_card

    m = {**_metrics("central", {"site-1": .9, "site-2": .8}), "global_spec": {"family": "cnn", "depth": "deep"}}
    card = model_card(m)
    assert "own architecture" not in card and "2 site models" not in card
    assert ("one model of the deepest site architecture (cnn/deep) trained with <code>central</code> (label scheme "
            "<code>binary</code>) on the pooled training images of the 2 sites, then scored at every site at 32 px")\
        in card
    assert "not a federated result and not deployable as one" in card
    fed = model_card(_metrics("fedavg", {"site-1": .7, "site-2": .75}))
    assert "2 site models trained with <code>fedavg</code>" in fed and "each at its own architecture" in fed
    assert "pooled-data reference" not in fed
