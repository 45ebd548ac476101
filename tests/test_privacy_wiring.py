"""DP-SGD wired into the site: the site config's ``dp`` key, the budget refused before training, every method that
sends weights trained under one accountant per site, and what leaves a site under dp (the payloads themselves,
inspected), with epsilon recomputed from the recorded values by Opacus's accountant."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from nvflare.app_common.abstract.fl_model import FLModel

pytestmark = pytest.mark.privacy
torch.set_num_threads(1)

from tests.synthetic_sites import SPEC, pairs_2_1_1, synthetic_site  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _site(tmp_path, name, n, dp=None):
    """A site of ``n`` small images (train : val : test about 2 : 1 : 1, both classes in each split)."""
    return synthetic_site(tmp_path, name, n, pairs_2_1_1, dp=dp)


# ------------------------------------------------------------------------------------------ config and refusals
@pytest.mark.parametrize("dp, key, match", [
    ({"delta": 1e-3}, "dp", "needs epsilon"),
    ({"epsilon": 8, "delta": 2.0}, "dp", "delta must be in"),
    ({"epsilon": -1}, "dp", "finite number > 0"),
    ({"epsilon": 8, "noise": 1}, "dp", "unknown key"),
    ("eight", "dp", "must be a mapping"),
])
def test_dp_key_errors_name_site_file_and_key(dp, key, match):
    from hfl_components.flare.site_config import SiteConfigError, validate_site_config

    raw = {"data": {"manifest": "/x.csv"}, "model": {"family": "cnn", "depth": "shallow"}, "dp": dp}
    with pytest.raises(SiteConfigError) as e:
        validate_site_config(raw, "hospital-a", "hospital-a.yaml", check_files=False)
    msg = str(e.value)
    assert "\n" not in msg and "hospital-a" in msg and "hospital-a.yaml" in msg and f"key '{key}'" in msg
    assert re.search(match, msg), msg


@pytest.mark.parametrize("other", [{"amp": True}, {"balanced_sampling": True}, {"class_weights": "balanced"}])
def test_dp_is_refused_with_settings_it_cannot_account(other):
    from hfl_components.flare.site_config import SiteConfigError, validate_site_config

    raw = {"data": {"manifest": "/x.csv"}, "model": {"family": "cnn", "depth": "shallow"}, "dp": {"epsilon": 8},
           **other}
    with pytest.raises(SiteConfigError, match=f"key '{next(iter(other))}'.*dp"):
        validate_site_config(raw, "hospital-a", "h.yaml", check_files=False)
    ok = validate_site_config({**raw, **{k: False if k != "class_weights" else None for k in other}}, "hospital-a",
                              "h.yaml", check_files=False)
    assert ok["dp"] == {"epsilon": 8}


def test_impossible_budget_is_refused_before_training_in_one_line_naming_the_site(tmp_path):
    """delta >= 1/n (6 training images, delta 0.5): the FedAvg round fails before any step -- no state is saved --
    with one line naming the site."""
    from hfl_components.flare.dispatch import handler
    from hfl_components.flare.messages import GLOBAL_PREFIX, to_numpy_state
    from hfl_components.flare.site_tasks import SiteRuntime
    from hfl_components.models import build_model
    from hfl_components.privacy import DPBudgetError

    rt = SiteRuntime(_site(tmp_path, "hospital-b", 12, dp={"epsilon": 8, "delta": 0.5}), tmp_path / "ws")
    params = {GLOBAL_PREFIX + k: v for k, v in to_numpy_state(build_model(SPEC).state_dict()).items()}
    meta = {"method": "fedavg", "global_spec": SPEC, "task_config": {"local_epochs": 1}, "round": 0, "total_rounds": 2}
    with pytest.raises(DPBudgetError) as e:
        handler("fedavg_train")(rt, params, meta)
    assert "\n" not in str(e.value) and str(e.value).startswith("site hospital-b:") and "delta" in str(e.value)
    assert not (rt.state_dir / "model.pt").exists()



def test_a_restarted_site_process_continues_its_dp_budget_from_the_workspace(tmp_path):
    """The site's runtime keeps its dp ledger in the workspace's state folder: a new runtime on the same workspace
    (a restarted site process) continues the spent steps and refuses the epochs beyond the job's plan."""
    from hfl_components.flare.site_tasks import SiteRuntime
    from hfl_components.privacy import DPBudgetError

    cfg = _site(tmp_path, "hospital-d", 24, dp={"epsilon": 8})  # 12 training images, batch 4: 3 steps an epoch
    rt = SiteRuntime(cfg, tmp_path / "ws")
    rt.train(1, 0.05, dp_epochs=2)
    assert rt.dp_record()["sessions"]["train"]["steps"] == 3 and (rt.state_dir / "dp_train.json").is_file()
    eps_one = rt.dp_record()["epsilon"]
    rt2 = SiteRuntime(cfg, tmp_path / "ws")
    rt2.train(1, 0.05, dp_epochs=2)
    rec = rt2.dp_record()
    assert rec["sessions"]["train"]["steps"] == 6 and rec["epsilon"] > eps_one and rec["epsilon"] <= 8.0
    with pytest.raises(DPBudgetError, match=r"^site hospital-d: dp budget was planned for 6 steps .* 6 are spent"):
        SiteRuntime(cfg, tmp_path / "ws").train(1, 0.05, dp_epochs=2)
    fresh = SiteRuntime(cfg, tmp_path / "other_ws")  # another job's workspace starts from zero
    fresh.train(1, 0.05, dp_epochs=2)
    assert fresh.dp_record()["sessions"]["train"]["steps"] == 3


def test_the_dp_noise_is_not_reproducible_from_the_jobs_seed(tmp_path):
    """The job's seed is known to the server and every peer; DP noise drawn from it could be regenerated and
    subtracted. Two runs of one site config (same seed, same images) give the same weights without dp and
    different weights with it, and the session's noise seed is not the config's seed."""
    from hfl_components.flare.site_tasks import SiteRuntime

    def weights(cfg, ws):
        rt = SiteRuntime(cfg, tmp_path / ws)
        rt.train(1, 0.05, dp_epochs=1) if cfg.get("dp") else rt.train(1, 0.05)
        return rt, torch.cat([p.detach().flatten() for p in rt.model.parameters()])

    for d in ("plain", "dp"):
        (tmp_path / d).mkdir()
    plain = _site(tmp_path / "plain", "hospital-e", 24)
    assert torch.equal(weights(plain, "p1")[1], weights(plain, "p2")[1])  # the runtime itself is deterministic
    cfg = _site(tmp_path / "dp", "hospital-e", 24, dp={"epsilon": 8})
    (rt1, w1), (rt2, w2) = weights(cfg, "d1"), weights(cfg, "d2")
    assert not torch.equal(w1, w2)
    seeds = {rt1._dp_sessions["train"].seed, rt2._dp_sessions["train"].seed}
    assert len(seeds) == 2 and int(cfg["seed"]) not in seeds


def test_a_prototype_method_is_refused_under_dp_naming_the_site(tmp_path):
    from hfl_components.flare.dispatch import handler
    from hfl_components.flare.site_tasks import SiteRuntime

    rt = SiteRuntime(_site(tmp_path, "hospital-c", 12, dp={"epsilon": 8}), tmp_path / "ws")
    with pytest.raises(ValueError, match=r"^site hospital-c: dp covers model weights, but fedsaf uploads"):
        handler("fedsaf_train")(rt, {}, {"method": "fedsaf", "task_config": {}})


def test_protect_answer_drops_unlisted_values_and_refuses_raw_losses(tmp_path):
    from hfl_components.flare.site_methods import DP_METRICS, protect_answer
    from hfl_components.flare.site_tasks import SiteRuntime

    rt = SiteRuntime(_site(tmp_path, "s", 12, dp={"epsilon": 8, "count_epsilon": 1.0}), tmp_path / "ws")
    params, metrics, meta = protect_answer(rt, "t", ({}, {"loss": [None], "proximal_last_batch": 0.3, "val": {}},
                                                     {"n_train": 6, "NUM_STEPS_CURRENT_ROUND": 6}))
    assert set(metrics) == {"loss", "val"} <= set(DP_METRICS)
    assert meta["n_train"] == meta["NUM_STEPS_CURRENT_ROUND"] == rt.released_count(6)  # noised once, same value
    with pytest.raises(ValueError, match="raw training losses"):
        protect_answer(rt, "t", ({}, {"loss": [0.69]}, {}))
    plain = SiteRuntime({**_site(tmp_path, "p", 12)}, tmp_path / "ws2")
    answer = ({}, {"loss": [0.69], "anything": 1}, {"n_train": 6})
    assert protect_answer(plain, "t", answer) is answer


def test_deployment_privacy_table_has_a_row_and_a_protection_for_every_catalogue_method():
    from hfl_components.flare.catalogue import builtin_methods

    doc = (REPO / "docs" / "DEPLOYMENT.md").read_text(encoding="utf-8")
    sec = doc.split("## Privacy: what leaves a site", 1)[1].split("\n## ", 1)[0]
    header = next(line for line in sec.splitlines() if line.startswith("| method |"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert "protection under dp" in cols, cols
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in sec.splitlines()
            if line.startswith("|") and not line.startswith(("| method", "|---"))]
    named = {n.strip().lower(): r for r in rows for n in r[0].split("/")}
    missing = [m for m in builtin_methods() if m not in named]
    assert not missing, f"docs/DEPLOYMENT.md privacy table lacks {missing}"
    i = cols.index("protection under dp")
    assert all(named[m][i] for m in builtin_methods())


# ------------------------------------------------------------------------------------------ in-process federations
def _federation(tmp_path, method, opts, dp, before=None):
    from hfl_components.flare.inprocess import InProcessTransport, runtime_answer
    from hfl_components.flare.site_tasks import SiteRuntime
    from nvflare_jobs.jobs import make_controller

    profile = {s: _site(tmp_path, s, n, dp=dp) for s, n in (("site-1", 28), ("site-2", 24))}
    runtimes = {s: SiteRuntime(cfg, tmp_path / "ws" / s) for s, cfg in profile.items()}
    real, seen = runtime_answer(runtimes, raise_errors=True), []

    def answer(task, site, data):
        if before is not None:  # e.g. restart a site's process (a new runtime on the same workspace)
            before(task, site, runtimes, profile)
        out = real(task, site, data)
        seen.append((task, site, out))
        return out

    ctl = make_controller(method, profile, opts)
    InProcessTransport(runtimes, answer).attach(ctl, tmp_path / "server", info=lambda m: None,
                                                warning=lambda m: None)
    ctl.run()
    return ctl, runtimes, seen


OPTS = {"fedavg": {"rounds": 2, "local_epochs": 1}, "fedprox": {"rounds": 2, "local_epochs": 1},
        "local": {"rounds": 2, "local_epochs": 1},
        "ohfl": {"local_epochs": 2, "finetune_epochs": 1, "probe": "generated", "probe_size": 8},
        "fens": {"rounds": 2, "local_epochs": 1, "fens_holdout": 0.5, "fens_epochs": 1}}


@pytest.mark.slow
def test_ohfl_site_restarted_between_its_two_steps_fine_tunes_on_the_same_dp_budget(tmp_path):
    """site-1's process is replaced by a new one (same workspace) before OHFL's fine-tuning: the new process
    continues the local training's dp session from the workspace's ledger, so the fine-tuning is accounted with
    it: 2 + 1 epochs of 3 steps (12 training images, batch 4) = 9 steps, epsilon <= 8, equal to the other site's
    uninterrupted count and to Opacus's accountant recomputed from the record."""
    from hfl_components.flare.site_tasks import SiteRuntime
    from hfl_components.privacy import epsilon_from_record

    restarted = []

    def restart(task, site, runtimes, profile):
        if site == "site-2" and "finetune" in task and not restarted:
            runtimes[site] = SiteRuntime(profile[site], tmp_path / "ws" / site)
            restarted.append(task)

    ctl, runtimes, seen = _federation(tmp_path, "ohfl", {**OPTS["ohfl"], "seed": 0}, {"epsilon": 8}, before=restart)
    assert restarted and any(t == restarted[0] and s == "site-2" for t, s, _ in seen)
    rec = runtimes["site-2"].dp_record()["sessions"]["train"]
    assert rec["steps"] == rec["planned_steps"] == 9 and 0 < rec["epsilon"] <= 8.0
    assert rec["epsilon"] == pytest.approx(epsilon_from_record(rec), rel=1e-9)
    assert runtimes["site-2"]._dp_sessions["train"].restored_steps == 6


@pytest.mark.slow
@pytest.mark.parametrize("method", list(OPTS))
def test_dp_run_payloads_hold_no_unprotected_training_value(tmp_path, method):
    """Every answer a site sends in a dp job: metrics only under a stated protection, every training loss dropped,
    the count the released one; the dp record in the answers, the server's record and the saved model files, its
    epsilon <= the target and equal to Opacus's accountant recomputed from the recorded noise multiplier, sample
    rate and steps."""
    from hfl_components.flare.site_methods import DP_METRICS
    from hfl_components.models import read_model_header
    from hfl_components.privacy import epsilon_from_record

    ctl, runtimes, seen = _federation(tmp_path, method, {**OPTS[method], "seed": 0}, {"epsilon": 8})
    assert seen
    for task, site, (params, metrics, meta) in seen:
        assert set(metrics) <= set(DP_METRICS), (task, set(metrics) - set(DP_METRICS))
        for k in ("loss", "finetune_loss"):
            assert all(v is None for v in metrics.get(k) or []), (task, k)
        assert meta["dp"]["dp"] is True and meta["n_train"] == runtimes[site].n_train()  # declared public
        if task != "evaluate" and params:  # weights leave only after DP training
            assert meta["dp"]["epsilon"] > 0, task
    for site, rt in runtimes.items():
        rec = ctl.record["sites"][site]["dp"]
        assert 0 < rec["epsilon"] <= 8.0
        for sess in rec["sessions"].values():
            assert sess["steps"] == sess["planned_steps"] > 0
            again = epsilon_from_record({k: sess[k] for k in ("accountant", "delta", "noise_multiplier",
                                                              "sample_rate", "steps")})
            assert again == pytest.approx(sess["epsilon"], rel=1e-6) and again <= 8.0
            assert sess["delta"] == pytest.approx(1 / (10 * sess["n_images"]))
        assert read_model_header(rt.state_dir / "model.pt")["provenance"]["dp"]["epsilon"] == rec["epsilon"]
        led = ctl.record["sites"][site]["releases"]
        assert {r["name"]: r["protection"] for r in led["releases"]}["training losses"] == "dropped"
    if method == "fens":  # the aggregator trains on the held-out images in its own session
        assert set(ctl.record["sites"]["site-1"]["dp"]["sessions"]) == {"train", "holdout"}


def test_status_report_and_model_card_say_plainly_whether_a_run_was_dp():
    from hfl_components.privacy import run_dp_line
    from nvflare_jobs.report import model_card

    sess = {"noise_multiplier": 0.56, "sample_rate": 0.25, "steps": 12, "epsilon": 7.9, "delta": 1e-3}
    dp = {"dp": True, "epsilon": 7.9, "target_epsilon": 8.0, "delta": 1e-3, "sessions": {"train": sess}}
    assert run_dp_line({"a": {"dp": {"dp": False}}, "b": {}}) == "not DP (no site trained with dp)"
    both = run_dp_line({"a": {"dp": dp}, "b": {"dp": {**dp, "epsilon": 7.5}}})
    assert both.startswith("DP-SGD at every site: epsilon <= 7.90 (target 8)") and "b 7.50" in both
    half = run_dp_line({"a": {"dp": dp}, "b": {"dp": {"dp": False}}})
    assert half.startswith("DP-SGD at 1 of 2 sites") and half.endswith("NOT DP: b")
    card = model_card({"method": "fedavg", "labels": "binary", "sites": {"a": {"dp": dp, "test": {}}}})
    assert "Differential privacy:</b> DP-SGD at every site" in card and "noise multiplier 0.56" in card
    assert "12 steps" in card
    assert "Differential privacy:</b> not DP" in model_card({"method": "fedavg", "sites": {"a": {"test": {}}}})


@pytest.mark.slow
def test_main_job_in_the_simulator_with_dp_epsilon_8_records_and_recomputes_epsilon(data_root, tmp_path):
    """A real simulator run of the main job (OHFL) with ``dp: {epsilon: 8}`` at every site: per site
    ``metrics.json`` records the noise multiplier, sample rate, steps and epsilon <= 8, which Opacus's accountant
    recomputes from those values alone; the deployed model files carry the same record; status says DP."""
    from hfl_components.models import read_model_header
    from hfl_components.privacy import epsilon_from_record
    from tests.sim_helpers import load_metrics, make_partition, make_profile, run_cli

    part = make_partition(data_root, tmp_path / "part", 3, max_images=150)
    profile = make_profile(part, tmp_path / "profile", "ohfl", dp={"epsilon": 8})
    run = tmp_path / "run"
    r = run_cli("simulate", "--method", "ohfl", "--profile", str(profile), "--probe", "generated",
                "--probe-size", "16", "--distill-steps", "10", "--out", str(run))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = load_metrics(run)
    assert sorted(m["sites"]) == ["site-1", "site-2", "site-3"]
    for site, b in m["sites"].items():
        rec = b["dp"]
        assert rec["dp"] is True and 0 < rec["epsilon"] <= 8.0, (site, rec)
        sess = rec["sessions"]["train"]
        assert sess["steps"] == sess["planned_steps"] > 0 and 0 < sess["sample_rate"] <= 1
        again = epsilon_from_record({k: sess[k] for k in ("accountant", "delta", "noise_multiplier", "sample_rate",
                                                          "steps")})
        assert again == pytest.approx(sess["epsilon"], rel=1e-6) and again <= 8.0
        assert {x["name"]: x["protection"] for x in b["releases"]["releases"]}["model weights"] == "dp"
        deployed = sorted((run / "models").glob(f"{site}_deployed*.pt"))
        assert deployed and read_model_header(deployed[0])["provenance"]["dp"]["epsilon"] == rec["epsilon"]
    st = run_cli("status", str(run))
    assert "privacy: DP-SGD at every site: epsilon <= " in st.stdout, st.stdout[-2000:]


@pytest.mark.slow
def test_a_monai_site_model_is_made_compatible_and_its_spec_rebuilds_it(tmp_path):
    """Local with a DenseNet (BatchNorm) site under dp: Opacus's ModuleValidator.fix replaces BatchNorm by GroupNorm,
    the spec says ``norm: group``, the saved model file loads back with the trained weights, and site check's
    compatibility line names the fix."""
    from hfl_components.flare.dispatch import handler
    from hfl_components.flare.site_tasks import SiteRuntime
    from hfl_components.models import build_model, load_model_file
    from hfl_components.privacy import compatibility_report

    spec = {"family": "densenet", "in_channels": 1, "num_classes": 2, "init_features": 8, "growth_rate": 4,
            "block_config": [2, 2]}
    cfg = {**_site(tmp_path, "hospital-d", 24, dp={"epsilon": 8}), "model": spec}
    rt = SiteRuntime(cfg, tmp_path / "ws")
    handler("local_train")(rt, {}, {"method": "local", "task_config": {"local_epochs": 1}, "round": 0,
                                    "total_rounds": 1})
    assert rt.spec["norm"] == "group" and not any("BatchNorm" in type(m).__name__ for m in rt.model.modules())
    model, header = load_model_file(rt.state_dir / "model.pt")
    for k, v in rt.model.state_dict().items():
        assert torch.equal(model.state_dict()[k].cpu(), v.cpu()), k
    assert header["provenance"]["dp"]["epsilon"] <= 8.0
    assert "made compatible by Opacus ModuleValidator.fix" in compatibility_report(build_model(spec))


@pytest.mark.parametrize("model, says", [
    ({"family": "cnn", "depth": "shallow"}, "compatible as is (no BatchNorm)"),
    pytest.param({"family": "densenet", "init_features": 8, "growth_rate": 4, "block_config": [2, 2]},
                 "made compatible by Opacus ModuleValidator.fix", marks=pytest.mark.slow),
])
def test_site_check_says_how_dp_trains_the_sites_model(tmp_path, model, says):
    import yaml

    from nvflare_jobs.site_check import check_site, format_report

    cfg = _site(tmp_path, "hospital-e", 12)
    raw = {"data": cfg["data"], "model": model, "input_size": 32, "dp": {"epsilon": 8}}
    (tmp_path / "hospital-e.yaml").write_text(yaml.safe_dump(raw))
    rep = check_site(tmp_path / "hospital-e.yaml", read_images=False)
    assert says in rep["dp"] and rep["dp"].startswith("epsilon 8")
    assert any(line.strip().startswith("dp ") and says in line for line in format_report(rep).splitlines())


def test_the_pooled_data_reference_is_refused_under_dp_naming_the_site(tmp_path):
    """central sends its training images: no DP-SGD budget covers that, so a site with dp refuses the task in one
    line naming the site, before anything is trained or sent."""
    from types import SimpleNamespace

    from hfl_components.flare.dispatch import _with_method

    calls = []
    handler = _with_method(lambda rt, params, meta: calls.append(1) or ({}, {}, {}))
    rt = SimpleNamespace(site="site-3", method=None, cfg={"dp": {"epsilon": 8}})
    with pytest.raises(ValueError, match=r"^site site-3: dp covers model weights, but central is the pooled-data"):
        handler(rt, {}, {"method": "central"})
    assert calls == []
