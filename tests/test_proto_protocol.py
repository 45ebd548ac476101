"""The prototype methods' data, training and comparison protocol: training pool without the evaluation
part, class-balanced sampling, tensor augmentation, Local on the same backbones at equal epochs, and the paired
site-model statistics (weighted AUC / balanced accuracy against scikit-learn, verdict wording, bootstrap)."""
from __future__ import annotations

import argparse
import csv
import json

import numpy as np
import pytest
import torch


def test_training_pool_is_tuning_plus_probe_and_never_evaluation(tmp_path, data_root):
    from chest_xray import scan_dataset
    from chest_xray.splits import TRAINING_PARTS, split_rows, write_pool_csv

    root = data_root / "chest_xray_224"
    if not root.is_dir():
        pytest.skip(f"no chest_xray_224 under {data_root}")
    with pytest.raises(ValueError, match="never trained on"):
        write_pool_csv(["tuning", "evaluation"], root, tmp_path / "x.csv")
    f = write_pool_csv(TRAINING_PARTS, root, tmp_path / "pool.csv")
    with f.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(split_rows("tuning")) + len(split_rows("probe")) == 735 + 320
    names = {r["path"].rsplit("/", 1)[-1].lower() for r in rows}
    assert not names & {r["path"].rsplit("/", 1)[-1].lower() for r in split_rows("evaluation")}
    recs, rep = scan_dataset(f, labels="subtype", verify=False)
    assert len(recs) == 1055 and rep["n_patients"] < 1055  # patient ids from the committed lists
    assert sorted({r["label"] for r in recs}) == [0, 1, 2]


def test_training_pool_with_chest_xray_original_appended(tmp_path, data_root):
    """``extra_roots``: every chest_xray_original image appended (850, subtypes from the file names), still no image
    of the evaluation part; a root holding pool images (chest_xray_224 itself) is refused."""
    from chest_xray import scan_dataset
    from chest_xray.splits import TRAINING_PARTS, split_rows, write_pool_csv

    root, orig = data_root / "chest_xray_224", data_root / "chest_xray_original"
    if not (root.is_dir() and orig.is_dir()):
        pytest.skip(f"no chest_xray_224 / chest_xray_original under {data_root}")
    f = write_pool_csv(TRAINING_PARTS, root, tmp_path / "pool.csv", extra_roots=[orig])
    recs, rep = scan_dataset(f, labels="subtype", verify=False)
    assert len(recs) == 1055 + 850
    from_orig = [r for r in recs if "chest_xray_original" in r["path"]]
    assert len(from_orig) == 850
    # chest_xray_original: NORMAL 330, bacterial 260, viral 260 (data README)
    assert np.bincount([r["label"] for r in from_orig], minlength=3).tolist() == [330, 260, 260]
    names = {r["path"].rsplit("/", 1)[-1].lower() for r in recs}
    assert not names & {r["path"].rsplit("/", 1)[-1].lower() for r in split_rows("evaluation")}
    with pytest.raises(ValueError, match="holds .* image"):
        write_pool_csv(TRAINING_PARTS, root, tmp_path / "bad.csv", extra_roots=[root])
    # a refused extra root (pool images, or missing) leaves an existing pool CSV as it was, and no partial file
    before = f.read_bytes()
    with pytest.raises(ValueError, match="extra data root .*chest_xray_224 holds 2770 image"):
        write_pool_csv(TRAINING_PARTS, root, f, extra_roots=[orig, root])
    with pytest.raises(FileNotFoundError, match="extra data root .*nope does not exist"):
        write_pool_csv(TRAINING_PARTS, root, f, extra_roots=[tmp_path / "nope"])
    assert f.read_bytes() == before and not (tmp_path / "bad.csv").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pool.csv"]


def test_balanced_sampler_weights_are_inverse_class_counts():
    from hfl_components.flare.site_tasks import balanced_sampler

    s = balanced_sampler([0, 0, 0, 1, 2, 2], torch.Generator().manual_seed(0))
    w = s.weights.numpy()
    np.testing.assert_allclose(w, [1 / 3, 1 / 3, 1 / 3, 1.0, 0.5, 0.5])
    # each class carries the same total probability mass
    np.testing.assert_allclose([w[:3].sum(), w[3:4].sum(), w[4:].sum()], [1.0, 1.0, 1.0])
    assert s.num_samples == 6 and s.replacement
    with pytest.raises(ValueError):
        balanced_sampler([], torch.Generator())


def test_tensor_augment_is_a_flip_and_zero_filled_shift():
    from chest_xray.transforms import TensorAugmentDataset

    x = torch.arange(2 * 20 * 20, dtype=torch.float32).reshape(2, 1, 20, 20) + 1
    same = TensorAugmentDataset(x, [0, 1], augment_classes=[])
    assert torch.equal(same[1]["image"], x[1]) and same[1]["label"] == 1
    ds = TensorAugmentDataset(x, [0, 1], augment_classes=[0], shift=0.1)  # up to 2 px
    assert torch.equal(ds[1]["image"], x[1])  # class 1 not augmented
    torch.manual_seed(0)
    for _ in range(20):
        out = ds[0]["image"]
        found = False
        for flip in (False, True):
            src = torch.flip(x[0], dims=(-1,)) if flip else x[0]
            for dy in range(-2, 3):
                for dx in range(-2, 3):
                    ref = torch.zeros_like(src)
                    ys, yd = (slice(0, 20 - dy), slice(dy, 20)) if dy >= 0 else (slice(-dy, 20), slice(0, 20 + dy))
                    xs, xd = (slice(0, 20 - dx), slice(dx, 20)) if dx >= 0 else (slice(-dx, 20), slice(0, 20 + dx))
                    ref[..., yd, xd] = src[..., ys, xs]
                    found |= torch.equal(out, ref)
        assert found
    assert torch.equal(x[0], torch.arange(400, dtype=torch.float32).reshape(1, 20, 20) + 1)  # cache untouched
    with pytest.raises(ValueError):
        TensorAugmentDataset(x, [0])


def _args(**kw):
    from nvflare_jobs.compare import CompareOptions

    return CompareOptions(**{"out": "runs/x", "labels": "subtype", **kw})


def test_local_runs_the_prototype_methods_budget_and_backbones_in_their_comparison(tmp_path):
    from nvflare_jobs.compare import epoch_plan, proto_protocol
    from nvflare_jobs.profiles import PROTO_LOCAL_EPOCHS, PROTO_ROUNDS, PROTO_TRAINING, write_profile
    from hfl_components.flare.site_config import load_profile

    assert proto_protocol(["local", "fedproto", "fedsaf:alignment=rcsa", "fedtopo"])
    assert not proto_protocol(["local", "ohfl"]) and not proto_protocol(["local"])
    a = _args()
    a.proto_protocol = True
    for m in ("local", "fedproto", "fedsaf", "fedtopo"):
        assert epoch_plan(m, a) == {"rounds": PROTO_ROUNDS, "local_epochs": PROTO_LOCAL_EPOCHS, "finetune_epochs": 0,
                                    "total_epochs_per_site": PROTO_ROUNDS * PROTO_LOCAL_EPOCHS}
    # outside the protocol: compare's equal budgets (Local = OHFL's local + fine-tuning epochs)
    assert epoch_plan("local", _args())["total_epochs_per_site"] == epoch_plan("ohfl", _args())["total_epochs_per_site"]
    part = tmp_path / "part"
    (part / "sites").mkdir(parents=True)
    for i in (1, 2):
        (part / "sites" / f"site-{i}.csv").write_text("path,label,split\n/x.png,0,train\n")
    prof = load_profile(write_profile(part, tmp_path / "prof", "local", "subtype", [64],
                                      {"seed": 0, "lr": 0.05}, proto=True), check_files=False)
    assert [c["model"]["family"] for c in prof.values()] == ["hetero_cnn", "densenet"]
    assert prof["site-2"]["model"]["block_config"] == [2, 2, 2]
    assert prof["site-1"]["lr"] == 0.05  # the caller's settings win
    assert prof["site-1"]["balanced_sampling"] is PROTO_TRAINING["balanced_sampling"]
    assert prof["site-1"]["fast_augment"] is PROTO_TRAINING["fast_augment"]
    assert prof["site-1"]["augment_classes"] == PROTO_TRAINING["augment_classes"] == "all"
    plain = load_profile(write_profile(part, tmp_path / "p2", "local", "subtype", [64], {"seed": 0}),
                         check_files=False)
    assert plain["site-1"]["model"]["family"] == "cnn" and plain["site-1"]["balanced_sampling"] is False


def test_weighted_auc_and_balanced_accuracy_equal_scikit_learn():
    from sklearn.metrics import balanced_accuracy_score, roc_auc_score

    from hfl_components.stats import site_metric, weighted_auc

    rng = np.random.default_rng(3)
    y = rng.integers(0, 3, 60)
    p = rng.dirichlet([1, 1, 1], 60)
    p[:10] = p[10:20]  # ties across rows
    w = rng.integers(0, 4, 60).astype(float)
    for c in range(3):
        assert weighted_auc(y == c, p[:, c], w) == pytest.approx(roc_auc_score(y == c, p[:, c], sample_weight=w))
    assert site_metric("balanced_accuracy", y, p, w) == pytest.approx(
        balanced_accuracy_score(y, p.argmax(1), sample_weight=w))
    macro = np.mean([roc_auc_score(y == c, p[:, c], sample_weight=w) for c in range(3)])
    assert site_metric("auc", y, p, w) == pytest.approx(macro)
    # a class with no weight is left out of both metrics
    w2 = np.where(y == 2, 0.0, 1.0)
    assert site_metric("auc", y, p, w2) == pytest.approx(
        np.mean([roc_auc_score(y[y < 2] == c, p[y < 2, c]) for c in range(2)]))
    with pytest.raises(ValueError):
        site_metric("f1", y, p)


def test_paired_nested_verdicts():
    from hfl_components.stats import paired_nested, verdict

    assert [verdict(0.01, 0.2), verdict(-0.1, 0.1), verdict(-0.3, -0.01), verdict(None, 1)] == [
        "better", "inconclusive", "worse", None]
    rng = np.random.default_rng(0)
    y = np.repeat([0, 1, 2], 20)
    good = np.eye(3)[y] * 0.8 + 0.1  # always right
    pairs_same, pairs_good = [], []
    for s in range(5):
        for k in range(2):
            ids = np.sort(rng.choice(60, 30, replace=False))
            noise = rng.dirichlet([1, 1, 1], 60)
            pairs_same.append({"seed": s, "site": k, "pool": "ext", "ids": ids, "y": y[ids], "pa": noise[ids],
                               "pb": noise[ids]})
            pairs_good.append({"seed": s, "site": k, "pool": f"{s}/{k}", "ids": np.arange(30), "y": y[ids],
                               "pa": good[ids], "pb": noise[ids]})
    d = paired_nested(pairs_same, "balanced_accuracy", n_boot=50)
    assert d["diff"] == 0 and d["ci_low"] == 0 and d["ci_high"] == 0 and d["verdict"] == "not worse"
    g = paired_nested(pairs_good, "auc", n_boot=50)
    assert g["a"] == 1.0 and g["n_pairs"] == 10 and g["verdict"] == "better"
    r = paired_nested([dict(q, pa=q["pb"], pb=q["pa"]) for q in pairs_good], "balanced_accuracy", n_boot=50)
    assert r["verdict"] == "worse" and r["a"] == pytest.approx(r["b"] + r["diff"]) and r["b"] == 1.0
    three = paired_nested([q for q in pairs_good if q["seed"] < 3], "auc", n_boot=50)
    assert three["verdict"] is None and not three["reliable"] and len(three["per_seed"]) == 3


def test_simulate_defaults_build_prototype_sites_from_the_training_parts(tmp_path, data_root, monkeypatch):
    import argparse as ap

    from chest_xray import read_site_manifest
    from chest_xray.splits import split_rows
    from nvflare_jobs.runner import prepare_profile
    from nvflare_jobs.spec import resolve
    from nvflare_jobs.profiles import PROTO_LOCAL_EPOCHS, PROTO_ROUNDS

    if not (data_root / "chest_xray_224").is_dir():
        pytest.skip(f"no chest_xray_224 under {data_root}")
    monkeypatch.setenv("CXR_DATA", str(data_root))
    args = resolve("fedtopo", {"scheme": "dirichlet"})
    assert (args.labels, args.rounds, args.site_epochs[0], args.input_sizes) == (
        "subtype", PROTO_ROUNDS, PROTO_LOCAL_EPOCHS, (64,))
    _, profile, data, _ = prepare_profile(args, tmp_path)
    assert data == tmp_path / "data_pool.csv"
    evaluation = {r["path"].rsplit("/", 1)[-1] for r in split_rows("evaluation")}
    n = 0
    for site, cfg in profile.items():
        assert cfg["input_size"] == 64 and cfg["balanced_sampling"] and cfg["fast_augment"]
        rows = read_site_manifest(cfg["data"]["manifest"])
        n += len(rows)
        assert not {str(r["path"]).rsplit("/", 1)[-1] for r in rows} & evaluation
    assert n == 1055
    assert [c["model"]["family"] for c in profile.values()][:4] == ["hetero_cnn", "densenet", "resnet", "efficientnet"]


def test_paired_nested_point_estimates_equal_site_metric():
    from hfl_components.stats import paired_nested, site_metric

    rng = np.random.default_rng(1)
    pairs = []
    for s in range(2):
        for k in range(3):
            y = rng.integers(0, 3, 25)
            pairs.append({"seed": s, "site": k, "pool": f"{s}/{k}", "ids": np.arange(25), "y": y,
                          "pa": rng.dirichlet([1, 1, 1], 25), "pb": rng.dirichlet([1, 1, 1], 25)})
    for metric in ("balanced_accuracy", "auc"):
        d = paired_nested(pairs, metric, n_boot=0)
        a = np.mean([site_metric(metric, q["y"], q["pa"]) for q in pairs])
        b = np.mean([site_metric(metric, q["y"], q["pb"]) for q in pairs])
        assert d["a"] == pytest.approx(a) and d["b"] == pytest.approx(b) and d["diff"] == pytest.approx(a - b)


def test_cosine_round_lr_factor_hand_values():
    from hfl_components.flare.site_tasks import round_lr_factor

    assert round_lr_factor(0, 4) == 1.0
    np.testing.assert_allclose([round_lr_factor(r, 4) for r in range(4)],
                               [1.0, 0.5 + 0.5 * np.sqrt(0.5), 0.5, 0.5 - 0.5 * np.sqrt(0.5)])
    with pytest.raises(ValueError, match="outside"):
        round_lr_factor(4, 4)


def _toy_runtime(tmp_path, **cfg_kw):
    """A SiteRuntime on 12 tiny synthetic tensors (no image files): its loader cache is pre-filled."""
    from hfl_components.flare.site_tasks import SiteRuntime
    from hfl_components.flare.site_config import DEFAULTS

    cfg = {**DEFAULTS, "site": "site-1", "data": {"manifest": str(tmp_path / "none.csv"), "labels": "subtype"},
           "model": {"family": "hetero_cnn", "in_channels": 1, "num_classes": 3, "feature_dim": 8}, **cfg_kw}
    rt = SiteRuntime(cfg, tmp_path / "ws")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 1, 16, 16, generator=g), torch.arange(12) % 3
    rt._loaders[("train", int(cfg["input_size"]), True)] = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=4)
    return rt


def test_adam_state_persists_across_rounds_and_cosine_sets_each_rounds_lr(tmp_path):
    rt = _toy_runtime(tmp_path, optimizer="adam", lr_schedule="cosine", input_size=16)
    rt.train(1, 0.01, rnd=0, total_rounds=4)
    opt = rt._opt
    assert isinstance(opt, torch.optim.Adam) and opt.param_groups[0]["lr"] == pytest.approx(0.01)
    step0 = next(iter(opt.state.values()))["step"].item()
    rt.train(1, 0.01, rnd=2, total_rounds=4)
    assert rt._opt is opt  # the same optimiser: its moments carry over
    assert next(iter(opt.state.values()))["step"].item() == step0 + 3  # 12 images / batch 4 = 3 steps a round
    assert opt.param_groups[0]["lr"] == pytest.approx(0.005)  # round 2 of 4: factor 0.5
    rt.set_model(rt.cfg["model"])  # a new model (e.g. a fine-tuning start) gets a fresh optimiser
    rt.train(1, 0.01, rnd=0)
    assert rt._opt is not opt
    sgd = _toy_runtime(tmp_path / "b", input_size=16)  # the default stays SGD, lr unscaled without a schedule
    sgd.train(1, 0.01, rnd=3, total_rounds=4)
    assert not hasattr(sgd, "_opt")


def test_site_config_rejects_unknown_optimizer_schedule_and_weight_decay(tmp_path):
    import yaml

    from hfl_components.flare.site_config import SiteConfigError, load_site_config

    man = tmp_path / "m.csv"
    man.write_text("path,label,split\n/x.png,0,train\n")
    base = {"data": {"manifest": str(man), "labels": "subtype"}, "model": {"family": "cnn", "depth": "shallow"}}
    for key, bad in (("optimizer", "rmsprop"), ("lr_schedule", "step"), ("weight_decay", -0.1)):
        f = tmp_path / f"site-1_{key}.yaml"
        f.write_text(yaml.safe_dump({**base, key: bad}))
        with pytest.raises(SiteConfigError, match=key):
            load_site_config("site-1", f)
    f = tmp_path / "ok.yaml"
    f.write_text(yaml.safe_dump({**base, "optimizer": "adamw", "lr_schedule": "cosine", "weight_decay": 0.01}))
    cfg = load_site_config("site-1", f)
    assert (cfg["optimizer"], cfg["lr_schedule"], cfg["weight_decay"]) == ("adamw", "cosine", 0.01)


def test_site_config_as_an_operator_types_it(tmp_path):
    """Hand-typed YAML: ``1e-4`` is a number (PyYAML alone reads it as text), a quoted number is refused with a
    hint, SGD momentum must be below 1; each error names the site, the file and the key in one line."""
    from hfl_components.flare.site_config import SiteConfigError, load_site_config

    man = tmp_path / "m.csv"
    man.write_text("path,label,split\n/x.png,0,train\n")
    head = f"data: {{manifest: {man}}}\nmodel: {{family: cnn, depth: shallow}}\n"
    f = tmp_path / "hospital-a.yaml"
    f.write_text(head + "optimizer: adamw\nlr: 1e-3\nweight_decay: 5E-4\nfinetune_lr: 2.5e-4\nseed: 7\n")
    cfg = load_site_config("hospital-a", f)
    assert (cfg["lr"], cfg["weight_decay"], cfg["finetune_lr"], cfg["seed"]) == (0.001, 0.0005, 0.00025, 7)
    for text, key, says in (('weight_decay: "0.1"', "weight_decay", "got '0.1' (quoted: a text, not a number"),
                            ("momentum: 1.5", "momentum", "must be a number in [0, 1), got 1.5"),
                            ("momentum: 1", "momentum", "must be a number in [0, 1), got 1"),
                            ("optimizer: Adam", "optimizer", "must be sgd, adam or adamw, got 'Adam'"),
                            ("lr_schedule: cosin", "lr_schedule", "must be constant or cosine, got 'cosin'"),
                            ("aspect: squash", "aspect", "must be one of stretch, letterbox, crop, got 'squash'"),
                            ("seed: 1e3", "seed", "must be an integer, got 1000.0")):
        f.write_text(head + text + "\n")
        with pytest.raises(SiteConfigError) as e:
            load_site_config("hospital-a", f)
        msg = str(e.value)
        assert msg == f"site 'hospital-a': config {f} key '{key}': " + msg.split(f"key '{key}': ", 1)[1], msg
        assert says in msg and "\n" not in msg, msg
    f.write_text(head + "momentum: 0.99\n")
    assert load_site_config("hospital-a", f)["momentum"] == 0.99


def test_efficientnet_bn_momentum_key_and_the_prototype_default():
    from hfl_components.models import build_model
    from nvflare_jobs.profiles import PROTO_BACKBONES

    base = {"family": "efficientnet", "in_channels": 1, "num_classes": 3, "feature_dim": 8, "input_size": 32,
            "blocks": ["r1_k3_s11_e1_i32_o16_se0.25"]}

    def moms(spec):
        return {m.momentum for m in build_model(spec).modules() if isinstance(m, torch.nn.BatchNorm2d)}

    assert moms(base) == {0.01}  # MONAI's default, unchanged without the key
    assert moms({**base, "bn_momentum": 0.1}) == {0.1}
    assert PROTO_BACKBONES["efficientnet"]["bn_momentum"] == 0.1
    with pytest.raises(ValueError, match="bn_momentum"):
        build_model({**base, "bn_momentum": 0.0})
    with pytest.raises(ValueError, match="unknown key"):
        build_model({"family": "resnet", "bn_momentum": 0.1})


def test_fedproto_default_weights_are_the_papers_instance_mse_at_nn_mseloss_scale():
    """FedProto's defaults: prototype level off, instance level 1/64, i.e. FedProto's reference loss
    lambda_FP * nn.MSELoss(z, P_g[y]) with lambda_FP = 1 at feature_dim 64; FedSAF and FedTopo keep 1 / 1, and the
    command line leaves each method its own default unless --lambda / --gamma is given."""
    from hfl_components.alignment import FedSAFAuxLoss
    from hfl_components.flare.catalogue import validate_options
    from nvflare_jobs.commands.simulate import cli_spec

    v = validate_options("fedproto", {})
    assert (v["lam"], v["gamma"], v["alignment"]) == (0.0, 1 / 64, "mse")
    for m in ("fedsaf", "fedtopo"):
        w = validate_options(m, {})
        assert (w["lam"], w["gamma"]) == (1.0, 1.0)
    assert validate_options("fedproto", {"lam": 0.5, "gamma": 2})["gamma"] == 2.0

    g = torch.Generator().manual_seed(0)
    z = torch.randn(10, 64, generator=g)
    Pg = torch.randn(3, 64, generator=g)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 0, 1, 2])
    got = FedSAFAuxLoss(Pg, "mse", lam=v["lam"], gamma=v["gamma"])(z, None, y)
    assert float(got) == pytest.approx(float(torch.nn.MSELoss()(z, Pg[y])), rel=1e-6)
    # a class missing from the global set contributes nothing (its row masked out)
    mask = torch.tensor([True, True, False])
    got = FedSAFAuxLoss(Pg, "mse", lam=0.0, gamma=1 / 64, global_mask=mask)(z, None, y)
    keep = y != 2
    assert float(got) == pytest.approx(float(torch.nn.MSELoss()(z[keep], Pg[y[keep]])), rel=1e-6)

    def parsed(*argv):
        a = cli_spec(["--method", argv[0], *argv[1:]])
        return a.lam, a.gamma

    assert parsed("fedproto") == (0.0, 1 / 64)
    assert parsed("fedsaf") == (1.0, 1.0)
    assert parsed("fedtopo") == (1.0, 1.0)
    assert parsed("fedproto", "--lambda", "1", "--gamma", "1") == (1.0, 1.0)


def test_deploy_best_val_keeps_the_round_with_the_best_validation_score_ties_to_the_later(tmp_path, monkeypatch):
    """deploy: best_val: scripted validation balanced accuracies 0.40, 0.60, 0.50, 0.60 (tie), 0.30 over
    five rounds of the real Local handler -> the deployed model file and the model the final evaluation task scores
    are round 3's weights (the later of the two 0.60 rounds), not round 4's; deploy: last deploys round 4's."""
    from hfl_components.flare.dispatch import handler
    from hfl_components.models import load_model_file

    for rule, expect in (("best_val", 3), ("last", 4)):
        rt = _toy_runtime(tmp_path / rule, optimizer="adam", lr=0.01, input_size=16, deploy=rule)
        scores = iter([0.40, 0.60, 0.50, 0.60, 0.30])
        monkeypatch.setattr(rt, "n_train", lambda: 12)
        monkeypatch.setattr(rt, "evaluate", lambda split="test", with_predictions=False: (
            {"balanced_accuracy": next(scores), "accuracy": 0.5} if split == "val" else {"balanced_accuracy": 0.5}))
        snaps = []
        for rnd in range(5):
            handler("local_train")(rt, {}, {"round": rnd, "total_rounds": 5, "method": "local",
                                            "task_config": {"local_epochs": 1}})
            snaps.append({k: v.detach().clone() for k, v in rt.model.state_dict().items()})
        assert any(not torch.equal(snaps[3][k], snaps[4][k]) for k in snaps[3])  # round 4 did change the weights
        deployed, _ = load_model_file(rt.state_dir / "deployed_model.pt")
        for k, v in deployed.state_dict().items():
            torch.testing.assert_close(v, snaps[expect][k].cpu())
        rec = json.loads((rt.state_dir / "deploy_selection.json").read_text())
        assert rec["round"] == expect and rec["score"] == pytest.approx(0.6 if rule == "best_val" else 0.3)
        scores = iter([0.5] * 2)  # the final evaluation task's validation score
        _, metrics, _ = handler("evaluate")(rt, {}, {"method": "local", "task_config": {}})
        # the evaluate answer says which round was deployed (metrics.json sites.<site>.deploy); only under best_val
        assert metrics.get("deploy") == ({"rule": "best_val", "round": 3, "score": 0.6} if rule == "best_val"
                                         else None)
        for k, v in rt.model.state_dict().items():
            torch.testing.assert_close(v.cpu(), snaps[expect][k].cpu())


def test_deploy_best_val_restarts_at_round_0_and_carries_the_prototypes_of_the_deployed_round(tmp_path):
    """A new job (round 0) starts a new record even if an earlier job scored higher; the local prototypes saved
    with a deployed round are the ones restored for the final (nearest-prototype) evaluation."""
    rt = _toy_runtime(tmp_path, input_size=16, deploy="best_val")
    rt.ensure_own_model()
    for rnd, score, proto in ((0, 0.9, 1.0), (0, 0.2, 2.0), (1, 0.1, 3.0), (2, 0.2, 4.0)):
        np.save(rt.state_dir / "local_prototypes.npy", np.full((3, 8), proto))
        rt.deploy_round({"balanced_accuracy": score}, rnd, extra_files=("local_prototypes.npy",))
    # second job: round 0 (0.2) deployed despite the first job's 0.9, round 1 (0.1) not, round 2 (0.2, tie) is
    assert json.loads((rt.state_dir / "deploy_selection.json").read_text())["round"] == 2
    np.save(rt.state_dir / "local_prototypes.npy", np.full((3, 8), 5.0))  # a later, not deployed, round
    rt.deploy_round({"balanced_accuracy": None}, 3, extra_files=("local_prototypes.npy",))  # None counts as -1
    assert rt.load_deployed(extra_files=("local_prototypes.npy",))
    np.testing.assert_array_equal(np.load(rt.state_dir / "local_prototypes.npy"), np.full((3, 8), 4.0))
    # a validation split with one class cannot rank rounds (it would favour predicting that class): every round
    # is deployed, as under deploy: last
    one = _toy_runtime(tmp_path / "one", input_size=16, deploy="best_val")
    one.ensure_own_model()
    for rnd, score in ((0, 0.9), (1, 0.3)):
        one.deploy_round({"balanced_accuracy": score, "class_counts": [15, 0, 0]}, rnd)
    assert json.loads((one.state_dir / "deploy_selection.json").read_text())["round"] == 1
    one.deploy_round({"balanced_accuracy": 0.2, "class_counts": [15, 1, 0]}, 2)  # two classes: ranked again
    assert json.loads((one.state_dir / "deploy_selection.json").read_text())["round"] == 1
    last = _toy_runtime(tmp_path / "last", input_size=16)
    last.ensure_own_model()
    last.deploy_round({"balanced_accuracy": 0.1}, 0)
    assert not last.load_deployed()  # deploy: last -- the current model is the deployed one


def test_site_config_deploy_rule_and_the_prototype_default(tmp_path):
    import yaml

    from nvflare_jobs.profiles import PROTO_TRAINING
    from hfl_components.flare.site_config import DEFAULTS, SiteConfigError, load_site_config

    assert DEFAULTS["deploy"] == "last" and PROTO_TRAINING["deploy"] == "best_val"
    man = tmp_path / "m.csv"
    man.write_text("path,label,split\n/x.png,0,train\n")
    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump({"data": {"manifest": str(man), "labels": "subtype"},
                                 "model": {"family": "cnn", "depth": "shallow"}, "deploy": "best"}))
    with pytest.raises(SiteConfigError, match="deploy"):
        load_site_config("site-1", f)


def test_compare_partitions_the_prototype_comparison_with_two_eval_images_per_class(tmp_path, monkeypatch):
    """compare's partition step passes min_eval_per_class = PROTO_MIN_EVAL_PER_CLASS (2) under the prototype
    protocol and 0 otherwise (OHFL comparisons keep the plain 80/10/10 cut)."""
    import chest_xray

    from nvflare_jobs.compare import prepare_partition
    from nvflare_jobs.profiles import PROTO_MIN_EVAL_PER_CLASS

    seen = []

    class Stop(Exception):
        pass

    def fake_partition(records, n_sites, scheme, **kw):
        seen.append(kw["min_eval_per_class"])
        raise Stop

    monkeypatch.setattr(chest_xray, "scan_dataset", lambda data, labels: ([], {}))
    monkeypatch.setattr(chest_xray, "partition_records", fake_partition)
    for proto in (True, False):
        a = argparse.Namespace(labels="subtype", max_images=None, sites=6, scheme="dirichlet", alpha=0.5,
                               proto_protocol=proto)
        with pytest.raises(Stop):
            prepare_partition(tmp_path, tmp_path / "seed0", a)
    assert PROTO_MIN_EVAL_PER_CLASS == 2 and seen == [2, 0]


def test_weight_ema_is_the_hand_computed_average_of_every_steps_weights_and_is_what_the_site_deploys(tmp_path):
    """Site config ``weight_ema: 0.5``: after training, :attr:`SiteRuntime.eval_model` holds e_1 = w_1,
    e_k = 0.5 e_(k-1) + 0.5 w_k over the weights w_k after each optimiser step (recorded here from a second run
    without the average; the average does not change training), BatchNorm running statistics included; the
    deployed model file holds the average, the state file the trained weights; a new model object restarts it."""
    from hfl_components.models import load_model_file
    from hfl_components.flare.site_config import validate_site_config

    bn = {"family": "resnet", "in_channels": 1, "num_classes": 3, "feature_dim": 8}  # has BatchNorm
    plain = _toy_runtime(tmp_path / "plain", optimizer="adam", lr=0.01, input_size=16, model=bn)
    plain.ensure_own_model()
    snaps = []
    plain._optimizer(plain.model, 0.01).register_step_post_hook(
        lambda *_: snaps.append({k: v.detach().clone() for k, v in plain.model.state_dict().items()}))
    plain.train(2, 0.01, rnd=0)
    assert len(snaps) == 6  # 12 images / batch 4 x 2 epochs
    expect = dict(snaps[0])
    for s in snaps[1:]:
        expect = {k: (0.5 * expect[k] + 0.5 * s[k]) if s[k].is_floating_point() else expect[k] for k in s}

    rt = _toy_runtime(tmp_path / "ema", optimizer="adam", lr=0.01, input_size=16, weight_ema=0.5, model=bn)
    rt.train(2, 0.01, rnd=0)
    for k, v in rt.model.state_dict().items():  # training itself is unchanged
        torch.testing.assert_close(v, snaps[-1][k])
    ema = rt.eval_model.state_dict()
    assert rt.eval_model is not rt.model
    floats = [k for k in expect if expect[k].is_floating_point()]
    assert any("running_mean" in k for k in floats)
    for k in floats:
        torch.testing.assert_close(ema[k], expect[k])
    assert any(not torch.allclose(ema[k], snaps[-1][k]) for k in floats)  # the average is not the last weights
    rt.save_state(deployed=True)
    deployed, _ = load_model_file(rt.state_dir / "deployed_model.pt")
    state, _ = load_model_file(rt.state_dir / "model.pt")
    for k in floats:
        torch.testing.assert_close(deployed.state_dict()[k], expect[k])
        torch.testing.assert_close(state.state_dict()[k], snaps[-1][k])
    rt.set_model(rt.cfg["model"])  # a new model: no average until it trains
    assert rt.eval_model is rt.model
    base = {"data": {"manifest": "x.csv", "labels": "subtype"},
            "model": {"family": "hetero_cnn", "in_channels": 1, "num_classes": 3}}
    assert validate_site_config(dict(base), "s", check_files=False)["weight_ema"] is None  # off by default
    assert validate_site_config({**base, "weight_ema": 0.9}, "s", check_files=False)["weight_ema"] == 0.9
    for bad in (1.0, -0.1, "0.9", True):
        with pytest.raises(ValueError, match="weight_ema"):
            validate_site_config({**base, "weight_ema": bad}, "s", check_files=False)


@pytest.mark.parametrize("setting,expected", [("all", {0, 1, 2}), ("auto", {1, 2}), ([], set()), ([2], {2})])
def test_augment_classes_all_augments_every_class_at_a_label_skewed_site(tmp_path, setting, expected):
    """Sixth tuning pass (proto_tuning.md): with ``auto`` only the classes smaller than the site's largest are
    flipped / shifted, a label shortcut at a skewed site; the prototype methods' default ``all`` augments every class
    of the label scheme, also one the site holds no image of. The set comes from the site's own training split
    (4 x class 0, 2 x class 1, 1 x class 2)."""
    import csv

    from PIL import Image

    from hfl_components.flare.site_config import validate_site_config
    from hfl_components.flare.site_tasks import SiteRuntime

    rng = np.random.default_rng(0)
    man = tmp_path / "site.csv"
    with man.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["path", "label", "split", "patient_id"])
        for k, lab in enumerate([0, 0, 0, 0, 1, 1, 2]):
            f = tmp_path / f"img{k}.png"
            Image.fromarray((rng.random((20, 24)) * 150 + 60).astype(np.uint8)).save(f)
            w.writerow([str(f), lab, "train", f"p{k}"])
    cfg = {"site": "site-1", "threads": 1, "seed": 0, "input_size": 16, "batch_size": 4, "augment_classes": setting,
           "fast_augment": True, "data": {"labels": "subtype", "manifest": str(man)},
           "model": {"family": "cnn", "depth": "shallow", "in_channels": 1, "num_classes": 3}}
    assert validate_site_config(dict(cfg), "site-1", check_files=False)["augment_classes"] == setting
    assert SiteRuntime(cfg, tmp_path / "ws").loader("train").dataset.augment == expected
    with pytest.raises(ValueError, match="augment_classes.*'all'"):
        validate_site_config({**cfg, "augment_classes": "every"}, "site-1", check_files=False)


def test_augment_classes_null_is_refused_not_guessed():
    """None means every class in the code (``build_transforms``, ``make_site_dataset``, ``batch_augment``,
    ``resolve_augment_classes``) but a site config's null once meant none: it is refused, naming the site, the key
    and both spellings, instead of silently changing what a site augments."""
    from chest_xray import resolve_augment_classes
    from hfl_components.flare.site_config import validate_site_config

    cfg = {"data": {"labels": "subtype"}, "model": {"family": "cnn", "depth": "shallow"}, "augment_classes": None}
    with pytest.raises(ValueError) as e:
        validate_site_config(cfg, "site-9", check_files=False, require_data=False)
    msg = str(e.value)
    assert "'site-9'" in msg and "'augment_classes'" in msg and "'all'" in msg and "[]" in msg
    rows = [{"label": 0}] * 3 + [{"label": 1}]
    assert resolve_augment_classes(None, rows, 3) == resolve_augment_classes("all", rows, 3) == [0, 1, 2]
    assert resolve_augment_classes([], rows, 3) == [] and resolve_augment_classes("auto", rows, 3) == [1]


@pytest.mark.parametrize("bad", ["ALL", "every", [0, "1"], [-1], [3], [True], [0, 0], True, 3])
def test_augment_classes_refuses_what_would_augment_nothing_or_the_wrong_class(bad):
    """An index outside 0..C-1 (or a bool, which Python counts as 0/1) matched no training label, so the site trained
    without augmentation while ``site check`` said OK; a duplicate is a typo. The error names the site, the key, the
    allowed range for the label scheme and the value received."""
    from hfl_components.flare.site_config import validate_site_config

    cfg = {"data": {"labels": "subtype"}, "model": {"family": "cnn", "depth": "shallow"}, "augment_classes": bad}
    with pytest.raises(ValueError) as e:
        validate_site_config(cfg, "site-9", check_files=False, require_data=False)
    msg = str(e.value)
    assert "'site-9'" in msg and "'augment_classes'" in msg and "0..2 (subtype labels)" in msg
    assert f"got {bad!r}" in msg and "\n" not in msg
    ok = validate_site_config({**cfg, "augment_classes": [2, 0]}, "site-9", check_files=False, require_data=False)
    assert ok["augment_classes"] == [2, 0]
    binary = {**cfg, "data": {"labels": "binary"}, "augment_classes": [2]}
    with pytest.raises(ValueError, match=r"0\.\.1 \(binary labels\), got \[2\]"):
        validate_site_config(binary, "site-9", check_files=False, require_data=False)
