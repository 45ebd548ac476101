"""Local training loop and metrics: learning, repeatability, aux loss, class weights, hand-checked metrics, CIs."""
import json

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score
from sklearn.utils.class_weight import compute_class_weight
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from hfl_components.models import build_model
from hfl_components.training import (
    balanced_class_weights,
    choose_threshold,
    compute_metrics,
    evaluate,
    extract_features,
    loader_labels,
    pooled_metrics_with_ci,
    predict_proba,
    train_local,
)
from hfl_components.training.metrics import _fast_scalars, predict_labels

torch.set_num_threads(1)
TINY = {"family": "cnn", "depth": "shallow", "width": 0.25, "in_channels": 1, "num_classes": 2}


def _synthetic(n=64, size=16, seed=0):
    """Class 1 has a bright centre square, class 0 does not; plus noise. Learnable in a few epochs."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 2
    x = 0.3 * torch.rand(n, 1, size, size, generator=g)
    c = size // 4
    x[y == 1, :, c:3 * c, c:3 * c] += 0.7
    return x, y


class DictDS(Dataset):
    """MONAI-style dataset yielding {"image", "label"} dicts, with a ``data`` list of row dicts."""

    def __init__(self, x, y):
        self.x, self.y = x, y
        self.data = [{"label": int(v)} for v in y]

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"image": self.x[i], "label": int(self.y[i])}


class Linear2(nn.Module):
    """features = identity on a flat input, head = Linear: makes hand computations easy."""

    def __init__(self, d=3, c=2):
        super().__init__()
        self.lin = nn.Linear(d, c)

    def features(self, x):
        return x.flatten(1)

    def head(self, z):
        return self.lin(z)

    def forward(self, x):
        return self.head(self.features(x))


def test_training_reduces_loss_on_learnable_problem():
    # a BatchNorm backbone at the default lr; the BN-free cnn family needs ~100 SGD steps to leave its initial
    # plateau at lr 0.01 on this problem, too slow for a unit test.
    x, y = _synthetic(size=32)
    torch.manual_seed(0)
    model = build_model({"family": "resnet", "num_classes": 2, "feature_dim": 16})
    seen = []
    hist = train_local(model, DataLoader(DictDS(x, y), batch_size=16, shuffle=True), epochs=6,
                       on_epoch=seen.append, seed=0)
    assert [h["epoch"] for h in hist] == list(range(1, 7)) and seen == hist
    assert all(h["n"] == 64 for h in hist)
    assert hist[-1]["loss"] < 0.5 * hist[0]["loss"]
    m = evaluate(model, DataLoader(TensorDataset(x, y), batch_size=32), num_classes=2)
    assert m["accuracy"] >= 0.9
    json.dumps(hist, allow_nan=False)


def test_seed_makes_training_repeatable():
    x, y = _synthetic()
    states = []
    for _ in range(2):
        torch.manual_seed(0)
        model = build_model(TINY)
        train_local(model, DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True), epochs=2, seed=123)
        states.append(model.state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    torch.manual_seed(0)
    other = build_model(TINY)
    train_local(other, DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True), epochs=2, seed=7)
    assert not all(torch.equal(states[0][k], other.state_dict()[k]) for k in states[0])


def test_aux_loss_is_called_and_contributes():
    x, y = _synthetic(n=32)
    calls = []

    def aux(z, logits, yy):
        calls.append((tuple(z.shape), tuple(logits.shape), tuple(yy.shape)))
        return 0.5 * z.pow(2).mean()

    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    torch.manual_seed(0)
    a = build_model(TINY)
    torch.manual_seed(0)
    b = build_model(TINY)
    ha = train_local(a, loader, epochs=1, aux_loss=aux, seed=0)
    hb = train_local(b, loader, epochs=1, seed=0)
    assert calls == [((16, a.feature_dim), (16, 2), (16,))] * 2
    assert ha[0]["aux"] > 0 and hb[0]["aux"] == 0.0
    assert ha[0]["loss"] == pytest.approx(ha[0]["ce"] + ha[0]["aux"])
    assert not torch.equal(a.fcs[0].weight, b.fcs[0].weight)  # the aux gradient changed the update


def test_class_weighted_ce_matches_hand_computation():
    x = torch.tensor([[1.0, 0.0, 2.0], [0.5, -1.0, 0.0], [0.0, 1.0, 1.0], [2.0, 2.0, -1.0]])
    y = torch.tensor([0, 1, 1, 1])
    model = Linear2()
    with torch.no_grad():
        W, b = model.lin.weight.numpy().copy(), model.lin.bias.numpy().copy()
    w = np.array([3.0, 0.5])
    hist = train_local(model, [(x, y)], epochs=1, lr=0.0, class_weights=torch.tensor(w))
    logits = x.numpy() @ W.T + b
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    yn = y.numpy()
    expected = -(w[yn] * logp[np.arange(4), yn]).sum() / w[yn].sum()
    assert hist[0]["ce"] == pytest.approx(expected, rel=1e-5)


def test_balanced_weights_match_sklearn_from_loader_or_counts():
    y = np.array([0, 0, 0, 1, 2, 2])
    ref = compute_class_weight("balanced", classes=np.array([0, 1, 2]), y=y)
    assert np.allclose(balanced_class_weights(np.bincount(y)).numpy(), ref)
    assert np.allclose(balanced_class_weights([4, 0, 2]).numpy(), [0.75, 0.0, 1.5])
    ds = DictDS(torch.zeros(6, 1, 8, 8), torch.as_tensor(y))
    assert loader_labels(DataLoader(ds, batch_size=4)).tolist() == y.tolist()
    with pytest.raises(ValueError):
        balanced_class_weights([0, 0])
    # "balanced" from the loader's labels gives the same loss as passing the weights explicitly
    x3 = torch.randn(6, 3)
    loader = DataLoader(TensorDataset(x3, torch.as_tensor(y)), batch_size=6)
    torch.manual_seed(0)
    h1 = train_local(Linear2(c=3), loader, epochs=1, lr=0.0, class_weights="balanced")
    torch.manual_seed(0)
    h2 = train_local(Linear2(c=3), loader, epochs=1, lr=0.0, class_weights=torch.tensor(ref, dtype=torch.float32))
    torch.manual_seed(0)
    h3 = train_local(Linear2(c=3), loader, epochs=1, lr=0.0, class_weights="balanced", class_counts=[3, 1, 2])
    assert h1[0]["ce"] == pytest.approx(h2[0]["ce"]) == pytest.approx(h3[0]["ce"])


def test_train_local_errors():
    with pytest.raises(ValueError, match="no batches"):
        train_local(Linear2(), [], epochs=1)
    with pytest.raises(ValueError, match="3 entries"):
        train_local(Linear2(), [(torch.zeros(2, 3), torch.tensor([0, 1]))], epochs=1, class_weights=[1.0, 1, 1])
    with pytest.raises(ValueError):
        train_local(Linear2(), [(torch.zeros(2, 3), torch.tensor([0, 1]))], epochs=0)


def test_binary_metrics_hand_computed():
    y = [0, 0, 1, 1, 1]
    p1 = np.array([0.1, 0.6, 0.4, 0.8, 0.9])
    probs = np.stack([1 - p1, p1], 1)
    m = compute_metrics(y, probs, 2)
    assert m["confusion_matrix"] == [[1, 1], [1, 2]]
    assert m["accuracy"] == pytest.approx(3 / 5)
    assert m["sensitivity"] == pytest.approx(2 / 3) and m["specificity"] == pytest.approx(1 / 2)
    assert m["balanced_accuracy"] == pytest.approx((2 / 3 + 1 / 2) / 2)
    assert m["per_class_recall"] == pytest.approx([1 / 2, 2 / 3])
    assert m["auc"] == pytest.approx(5 / 6)
    assert m["log_loss"] == pytest.approx(-np.mean(np.log([0.9, 0.4, 0.4, 0.8, 0.9])))
    t = compute_metrics(y, probs, 2, threshold=0.35)
    assert t["threshold"] == 0.35 and t["sensitivity"] == 1.0 and t["specificity"] == 0.5
    assert t["auc"] == m["auc"]  # AUC does not depend on the threshold
    json.dumps(m, allow_nan=False)


def test_one_class_metrics_are_none_not_nan():
    probs = np.array([[0.2, 0.8], [0.7, 0.3], [0.4, 0.6]])
    m = compute_metrics([1, 1, 1], probs, 2)
    assert m["auc"] is None and m["specificity"] is None and m["per_class_recall"][0] is None
    assert m["sensitivity"] == pytest.approx(2 / 3) and m["accuracy"] == pytest.approx(2 / 3)
    neg = compute_metrics([0, 0, 0], probs, 2)
    assert neg["sensitivity"] is None and neg["specificity"] == pytest.approx(1 / 3)
    json.dumps([m, neg], allow_nan=False)
    empty = compute_metrics([], np.zeros((0, 2)), 2)
    assert empty["n"] == 0 and empty["accuracy"] is None
    ci = pooled_metrics_with_ci([1, 1, 1], probs, 2, n_boot=20)
    assert ci["auc"] == {"value": None, "ci_low": None, "ci_high": None}
    json.dumps(ci, allow_nan=False)


def test_multiclass_auc_matches_sklearn_ovr_macro():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 60)
    probs = rng.dirichlet([1, 1, 1], 60)
    probs[np.arange(60), y] += 0.5
    probs /= probs.sum(1, keepdims=True)
    m = compute_metrics(y, probs, 3)
    assert m["auc"] == pytest.approx(roc_auc_score(y, probs, multi_class="ovr", average="macro"))
    # subtype task: sensitivity = any-pneumonia (class != 0) detected as any pneumonia class
    pred = probs.argmax(1)
    assert m["sensitivity"] == pytest.approx(np.mean(pred[y != 0] != 0))
    assert m["specificity"] == pytest.approx(np.mean(pred[y == 0] == 0))
    # a class missing from the split: macro over the defined one-vs-rest AUCs
    keep = y != 2
    m2 = compute_metrics(y[keep], probs[keep], 3)
    assert m2["auc_per_class"][2] is None and m2["per_class_recall"][2] is None
    assert m2["auc"] == pytest.approx(np.mean(m2["auc_per_class"][:2]))


def test_choose_threshold_youden():
    assert choose_threshold([0, 0, 1, 1], [0.1, 0.3, 0.6, 0.8]) == pytest.approx(0.6)
    y = [0, 0, 0, 1, 1, 1]
    p = [0.2, 0.45, 0.5, 0.4, 0.7, 0.9]
    t = choose_threshold(y, p)
    j = [np.mean(np.array(p)[3:] >= s) + np.mean(np.array(p)[:3] < s) - 1 for s in p]
    assert np.mean(np.array(p)[3:] >= t) + np.mean(np.array(p)[:3] < t) - 1 == pytest.approx(max(j))
    assert choose_threshold([1, 1], [0.2, 0.9]) == 0.5


def test_bootstrap_ci_contains_point_and_repeats():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 120)
    p1 = np.clip(0.35 * y + 0.65 * rng.random(120), 0, 1)
    probs = np.stack([1 - p1, p1], 1)
    a = pooled_metrics_with_ci(y, probs, 2, n_boot=200, seed=0)
    b = pooled_metrics_with_ci(y, probs, 2, n_boot=200, seed=0)
    assert a == b
    point = compute_metrics(y, probs, 2)
    for key in ("accuracy", "balanced_accuracy", "auc", "sensitivity", "specificity", "log_loss"):
        r = a[key]
        assert r["value"] == pytest.approx(point[key])
        assert r["ci_low"] <= r["value"] <= r["ci_high"], key
        assert r["ci_low"] < r["ci_high"]
    assert all(r["ci_low"] <= r["value"] <= r["ci_high"] for r in a["per_class_recall"])
    json.dumps(a, allow_nan=False)
    # the replicate path computes the same numbers as the point estimate on the original sample
    fast = _fast_scalars(y, probs, predict_labels(probs), 2)
    for key in ("accuracy", "balanced_accuracy", "auc", "sensitivity", "specificity", "log_loss"):
        assert fast[key] == pytest.approx(point[key])


def test_predict_proba_features_and_evaluate_on_dict_loader():
    x, y = _synthetic(n=20, size=32)  # densenet needs >= 32 px
    torch.manual_seed(0)
    model = build_model({"family": "densenet", "num_classes": 2, "feature_dim": 16})
    model.train()
    loader = DataLoader(DictDS(x, y), batch_size=8)
    probs, labels = predict_proba(model, loader)
    assert probs.shape == (20, 2) and np.allclose(probs.sum(1), 1) and labels.tolist() == y.tolist()
    Z, yz = extract_features(model, loader)
    assert Z.shape == (20, 16) and Z.dtype == np.float32 and yz.tolist() == y.tolist()
    assert model.training  # mode restored
    m = evaluate(model, loader, num_classes=2)
    assert m["n"] == 20 and m["class_counts"] == [10, 10]
    json.dumps(m, allow_nan=False)


def test_grad_clip_bounds_the_first_sgd_step():
    """With momentum the first SGD step is lr * g; clipping makes ||step|| = lr * clip when ||g|| > clip."""
    torch.manual_seed(0)
    model = build_model({"family": "cnn", "depth": "shallow", "width": 0.25, "in_channels": 1, "num_classes": 2})
    x, y = torch.rand(8, 1, 32, 32), torch.tensor([0, 1] * 4)
    huge = lambda z, logits, yy: 1e6 * (z ** 2).mean()  # noqa: E731 - an aux loss with an enormous gradient
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    train_local(model, DataLoader(TensorDataset(x, y), batch_size=8), 1, lr=0.01, aux_loss=huge, grad_clip=2.0)
    step = torch.cat([p.detach().flatten() for p in model.parameters()]) - before
    assert float(step.norm()) == pytest.approx(0.01 * 2.0, rel=1e-3)


def test_device_check_imports_neither_torch_nor_sklearn():
    """The CLI checks --device names before anything runs: that import must not pull in torch or scikit-learn
    (seconds of start-up), while every public name of hfl_components.training still resolves to its submodule's."""
    import subprocess
    import sys

    code = ("import sys, hfl_components.training.device as d; d.check_device_name('cuda:1'); "
            "print(sorted(m for m in ('torch', 'sklearn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    import hfl_components.training as training
    from hfl_components.training import device, loop, metrics

    for name in training.__all__:
        owner = next(m for m in (device, loop, metrics) if hasattr(m, name))
        assert getattr(training, name) is getattr(owner, name)
    with pytest.raises(AttributeError, match="no_such_name"):
        training.no_such_name  # noqa: B018
    # the submodules stay attributes of the package, as when it imported them eagerly (in a fresh interpreter,
    # where nothing has imported them yet)
    code = ("import hfl_components.training as t; "
            "print(t.loop.__name__, t.metrics.compute_metrics is t.compute_metrics, 'loop' in dir(t))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["hfl_components.training.loop", "True", "True"]
