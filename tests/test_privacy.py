"""Differential privacy at a site (hfl_components.privacy.dp, train_local(dp=...)), the release ledger, and the
membership-inference measurement tools (hfl_components.privacy.mia)."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hfl_components.models import build_model
from hfl_components.privacy import (
    DPBudgetError, DPSession, DPSpec, ReleaseLedger, attack_metrics, audit_p_value, auc, check_budget,
    compatibility_report, default_delta, epsilon_from_record, epsilon_lower_bound, lira_offline, logit_confidence,
    loss_threshold_attack, make_compatible, model_logits, noisy_count, one_run_audit, per_example_losses,
    release_history, tpr_at_fpr,
)
from hfl_components.training import seed_everything, train_local
from hfl_components.training.proximal import ProximalTerm

pytestmark = pytest.mark.privacy
torch.set_num_threads(1)

SPEC = {"family": "cnn", "depth": "shallow", "width": 0.25, "in_channels": 1, "num_classes": 2}


def _data(n: int, size: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, size, size, generator=g), torch.randint(0, 2, (n,), generator=g)


def _loader(n: int, batch: int, seed: int = 0):
    x, y = _data(n, seed=seed)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(seed))


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return build_model(SPEC)


# ------------------------------------------------------------------------------------------------ budget and record
def test_dp_training_reaches_at_most_the_target_epsilon_and_the_record_recomputes_it():
    from opacus.accountants import RDPAccountant

    n, batch, epochs = 40, 8, 3
    plan = check_budget(n, batch, epochs, DPSpec(epsilon=8.0, accountant="rdp"), "site-3")
    assert plan.steps_per_epoch == math.ceil(n / batch) == 5 and plan.steps == 15
    assert plan.sample_rate == pytest.approx(1 / 5) and plan.delta == pytest.approx(1 / (10 * n))
    session = DPSession(plan, seed=0)
    model, loader = _model(), _loader(n, batch)
    train_local(model, loader, 2, dp=session, seed=0)   # e.g. round 1 ...
    train_local(model, loader, 1, dp=session, seed=1)   # ... and round 2 of one job
    rec = session.record()
    assert rec["steps"] == 15 and rec["epsilon"] <= 8.0
    assert rec["epsilon"] > 7.5  # the noise is calibrated to the budget, not far below it
    # recomputed from the recorded values alone with a fresh Opacus accountant
    acc = RDPAccountant()
    acc.history = [(rec["noise_multiplier"], rec["sample_rate"], rec["steps"])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert acc.get_epsilon(delta=rec["delta"]) == pytest.approx(rec["epsilon"], rel=1e-9)
    assert epsilon_from_record(rec) == pytest.approx(rec["epsilon"], rel=1e-9)
    assert list(model.state_dict()) == list(_model().state_dict())  # no Opacus wrapper left in the keys
    assert all(not hasattr(p, "grad_sample") for p in model.parameters())


def test_prv_accountant_plan_meets_the_target():
    plan = check_budget(110, 16, 5, DPSpec(epsilon=8.0), "site-1")  # Opacus's default accountant
    rec = {"accountant": "prv", "delta": plan.delta, "noise_multiplier": plan.noise_multiplier,
           "sample_rate": plan.sample_rate, "steps": plan.steps}
    assert plan.accountant == "prv" and plan.steps == 5 * 7
    assert 7.9 < epsilon_from_record(rec) <= 8.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_images=50, batch_size=16, epochs=2, spec=DPSpec(epsilon=8, delta=0.02)), "below 1/n"),
    (dict(n_images=10, batch_size=16, epochs=2, spec=DPSpec(epsilon=8)), "exceeds the 10 training images"),
    (dict(n_images=0, batch_size=16, epochs=2, spec=DPSpec(epsilon=8)), "needs training images"),
    (dict(n_images=20, batch_size=20, epochs=200, spec=DPSpec(epsilon=1e-6, accountant="rdp")),
     "cannot be reached"),
])
def test_impossible_budget_is_refused_in_one_line_naming_the_site(kwargs, match):
    with pytest.raises(DPBudgetError, match=match) as e:
        check_budget(site="site-7", **kwargs)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("site site-7:")


class _FlooredAccountant:
    """A stand-in accountant with a hand-made epsilon of noise multiplier sigma: ``0.01 + 1 / sigma`` (a floor of
    0.01, as the real accountants have one for a fixed delta); counts its calls."""

    calls = 0

    def __init__(self, *a, **k):
        self.history = []

    def get_epsilon(self, delta, **kwargs):
        type(self).calls += 1
        return 0.01 + 1.0 / self.history[-1][0]


def test_an_epsilon_below_the_accountants_floor_is_refused_without_searching_to_the_cap(monkeypatch):
    """Epsilon 0.001 under a floor of 0.01: Opacus's search doubled sigma 17 times up to its cap of 1e6 before it
    gave up (minutes of accountant calls for ``site check`` under the real accountants). The fall of epsilon over a
    doubling drops below 1 % once 1 / (2 sigma) < 0.01 (0.01 + 1 / sigma), i.e. at sigma = 20 x 2^9 = 10240:
    ten calls, and the refusal names the floor, 0.01 + 1 / 10240."""
    import opacus.accountants
    import opacus.accountants.utils

    make = lambda mechanism="rdp", **k: _FlooredAccountant()  # noqa: E731
    monkeypatch.setattr(opacus.accountants, "create_accountant", make)
    monkeypatch.setattr(opacus.accountants.utils, "create_accountant", make)
    _FlooredAccountant.calls = 0
    with pytest.raises(DPBudgetError) as e:
        check_budget(20, 16, 1, DPSpec(epsilon=0.001, accountant="rdp"), "site-7")
    msg = str(e.value)
    assert msg.startswith("site site-7: dp epsilon 0.001 cannot be reached") and "\n" not in msg
    assert f"stops falling at about {0.01 + 1 / 10240:.3g}" in msg, msg
    assert _FlooredAccountant.calls == 10
    _FlooredAccountant.calls = 0
    assert check_budget(20, 16, 1, DPSpec(epsilon=0.02, accountant="rdp"), "site-7").noise_multiplier > 0  # reachable


def test_more_epochs_than_planned_are_refused_before_a_step():
    plan = check_budget(20, 10, 1, DPSpec(epsilon=8, accountant="rdp"), "site-2")
    session, model = DPSession(plan, seed=0), _model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(DPBudgetError, match="site site-2: dp budget was planned for 2 steps"):
        train_local(model, _loader(20, 10), 2, dp=session)
    assert session.steps_done == 0 and all(torch.equal(a, p) for a, p in zip(before, model.parameters()))



def test_a_session_restored_from_its_ledger_continues_the_spent_budget(tmp_path):
    """A site process dies after 2 of its job's 3 planned epochs; the restarted process's session (same plan, same
    ledger file) holds the 10 spent steps, refuses 2 more epochs, and after the last epoch ends where one
    uninterrupted session ends: 15 steps and the epsilon of 15 steps (a fresh accountant recomputes it)."""
    from opacus.accountants import RDPAccountant

    n, batch, spec = 40, 8, DPSpec(epsilon=8.0, accountant="rdp")
    plan, ledger = check_budget(n, batch, 3, spec, "site-3"), tmp_path / "ws" / "dp_train.json"
    model, loader = _model(), _loader(n, batch)
    first = DPSession(plan, seed=0, ledger=ledger)
    train_local(model, loader, 2, dp=first, seed=0)
    assert first.steps_done == 10 and ledger.is_file() and first.epsilon() > 0
    again = DPSession(check_budget(n, batch, 3, spec, "site-3"), seed=0, ledger=ledger)  # the restarted process
    assert again.restored_steps == again.steps_done == 10
    assert again.epsilon() == pytest.approx(first.epsilon(), rel=1e-12)
    assert DPSession(plan, seed=0).epsilon() == 0.0  # without the ledger a restart would count from zero
    with pytest.raises(DPBudgetError, match="site site-3: dp budget was planned for 15 steps.* 10 are spent"):
        train_local(model, loader, 2, dp=again)
    train_local(model, loader, 1, dp=again, seed=1)
    rec = again.record()
    acc = RDPAccountant()
    acc.history = [(plan.accounted_noise_multiplier, plan.sample_rate, 15)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert rec["steps"] == 15 and rec["epsilon"] == pytest.approx(acc.get_epsilon(delta=plan.delta), rel=1e-9)
    assert epsilon_from_record(rec) == pytest.approx(rec["epsilon"], rel=1e-9) and rec["epsilon"] <= 8.0
    # the restored noise stream is not the one the first 10 steps used
    fresh, restored = DPSession(plan, seed=0), DPSession(plan, seed=0, ledger=ledger)
    assert not torch.equal(torch.randn(4, generator=fresh.noise_generator("cpu")),
                           torch.randn(4, generator=restored.noise_generator("cpu")))


def test_a_ledger_of_another_plan_or_an_unreadable_one_is_refused_naming_site_and_file(tmp_path):
    spec, ledger = DPSpec(epsilon=8.0, accountant="rdp"), tmp_path / "dp_train.json"
    session = DPSession(check_budget(40, 8, 3, spec, "site-3"), seed=0, ledger=ledger)
    train_local(_model(), _loader(40, 8), 1, dp=session, seed=0)
    with pytest.raises(DPBudgetError) as e:  # the restarted site's config now plans 4 epochs
        DPSession(check_budget(40, 8, 4, spec, "site-3"), seed=0, ledger=ledger)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("site site-3: dp ledger") and str(ledger) in msg and "epochs" in msg
    ledger.write_text("{not json")
    with pytest.raises(ValueError, match=r"^site site-3: dp ledger .*dp_train.json is unreadable"):
        DPSession(check_budget(40, 8, 3, spec, "site-3"), seed=0, ledger=ledger)


@pytest.mark.parametrize("raw, match", [
    ({"epsilon": 0}, "dp.epsilon must be a finite number > 0"),
    ({"epsilon": float("inf")}, "leave dp out"),
    ({"epsilon": 8, "delta": 1.5}, "dp.delta must be in"),
    ({"epsilon": 8, "accountant": "gdp"}, "dp.accountant must be one of"),
    ({"epsilon": "8"}, "must be a number"),
    ({"delta": 1e-5}, "needs epsilon"),
    ({"epsilon": 8, "epsilom": 1}, "unknown key"),
    ([8], "must be a mapping"),
])
def test_dp_config_errors_name_site_file_and_key(raw, match):
    with pytest.raises(ValueError, match=match) as e:
        DPSpec.from_config(raw, "hospital-a", "/k/hospital-a.yaml")
    assert str(e.value).startswith("site hospital-a: config /k/hospital-a.yaml key dp") and "\n" not in str(e.value)


def test_default_delta_is_strictly_below_one_over_n():
    for n in (1, 7, 110, 10_000):
        assert default_delta(n) == pytest.approx(1 / (10 * n)) and default_delta(n) < 1 / n


# ------------------------------------------------------------------------------------------------ the training loop
def test_dp_off_gives_the_plain_sgd_weights_bit_for_bit():
    """train_local without dp (and with dp=None) equals a hand-written SGD loop: the dp hook changes nothing."""
    a, b, ref = _model(1), _model(1), _model(1)
    train_local(a, _loader(24, 8, seed=3), 2, lr=0.05, seed=11)  # a fresh loader each: its shuffle generator
    train_local(b, _loader(24, 8, seed=3), 2, lr=0.05, seed=11, dp=None)
    seed_everything(11)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    ref.train()
    loader = _loader(24, 8, seed=3)
    for _ in range(2):
        for x, y in loader:
            loss = nn.functional.cross_entropy(ref.head(ref.features(x)), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    for (k, pa), pb, pr in zip(a.state_dict().items(), b.state_dict().values(), ref.state_dict().values()):
        assert torch.equal(pa, pb) and torch.equal(pa, pr), k


def test_dp_history_carries_only_releasable_values():
    plan = check_budget(24, 8, 2, DPSpec(epsilon=8, accountant="rdp"), "site-1")
    hist = train_local(_model(), _loader(24, 8), 2, dp=DPSession(plan, seed=0), class_weights="balanced")
    assert [set(h) for h in hist] == [{"epoch", "loss", "dp", "seconds"}] * 2
    assert all(h["loss"] is None and h["dp"] is True for h in hist)
    assert release_history(hist, dp=True) == [{"epoch": 1, "loss": None, "dp": True}, {"epoch": 2, "loss": None,
                                                                                       "dp": True}]
    with pytest.raises(ValueError, match="raw training loss"):
        release_history([{"epoch": 1, "loss": 0.3, "n": 24}], dp=True)


def test_noisy_losses_are_accounted_with_the_gradients():
    plan = check_budget(24, 8, 2, DPSpec(epsilon=8, accountant="rdp", losses="noisy"), "site-1")
    assert plan.accounted_noise_multiplier == pytest.approx(plan.noise_multiplier / math.sqrt(2))
    session = DPSession(plan, seed=0)
    hist = train_local(_model(), _loader(24, 8), 2, dp=session)
    assert all(isinstance(h["loss"], float) and math.isfinite(h["loss"]) for h in hist)
    rec = session.record()
    assert rec["history"] == [[pytest.approx(plan.accounted_noise_multiplier), plan.sample_rate, plan.steps]]
    assert rec["epsilon"] <= 8.0


def test_proximal_term_reaches_the_update_and_batch_dependent_aux_is_refused():
    plan = check_budget(24, 8, 1, DPSpec(epsilon=8, accountant="rdp"), "site-1")
    runs = {}
    for mu in (0.0, 50.0):  # same noise and batches: only the proximal term differs
        model = _model(2)
        anchor = [p.detach().clone() for p in model.parameters()]
        train_local(model, _loader(24, 8), 1, lr=0.01, momentum=0.0, seed=5, aux_loss=ProximalTerm(model, mu),
                    dp=DPSession(plan, seed=9))
        runs[mu] = sum(float((p.detach() - a).norm()) for p, a in zip(model.parameters(), anchor))
    assert 0 < runs[50.0] < runs[0.0]  # pulled back towards the anchor: the term was applied

    def feature_penalty(z, logits, y):
        return z.pow(2).mean()

    with pytest.raises(ValueError, match="depends on the batch"):
        train_local(_model(), _loader(24, 8), 1, aux_loss=feature_penalty, dp=DPSession(plan, seed=0))


class _BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(4, 2)

    def features(self, x):
        return self.body(x)

    def head(self, z):
        return self.fc(z)

    def forward(self, x):
        return self.head(self.features(x))


def test_batchnorm_model_is_refused_naming_the_site_then_fixed_by_opacus():
    plan = check_budget(24, 8, 1, DPSpec(epsilon=8, accountant="rdp"), "site-4")
    with pytest.raises(ValueError, match="site site-4: dp cannot train this model") as e:
        train_local(_BNNet(), _loader(24, 8), 1, dp=DPSession(plan))
    assert "make_compatible" in str(e.value)
    fixed, report = make_compatible(_BNNet())
    assert report["changed"] and report["replaced"] == {"BatchNorm2d": 1} and not report["remaining"]
    assert "GroupNorm" in report["text"] and not any(isinstance(m, nn.BatchNorm2d) for m in fixed.modules())
    train_local(fixed, _loader(24, 8), 1, dp=DPSession(plan, seed=0))
    assert compatibility_report(_model()) == "dp: compatible as is (no BatchNorm)"


def test_dp_refuses_amp_and_a_balanced_sampler():
    plan = check_budget(24, 8, 1, DPSpec(epsilon=8, accountant="rdp"), "site-1")
    with pytest.raises(ValueError, match="amp"):
        train_local(_model(), _loader(24, 8), 1, amp=True, dp=DPSession(plan))
    x, y = _data(24)
    weighted = DataLoader(TensorDataset(x, y), batch_size=8,
                          sampler=torch.utils.data.WeightedRandomSampler(torch.ones(24), 24))
    with pytest.raises(ValueError, match="site site-1: .*balanced_sampling"):
        train_local(_model(), weighted, 1, dp=DPSession(plan))


# ------------------------------------------------------------------------------------------------ releases
def test_noisy_count_is_discrete_laplace():
    eps = 0.5
    draws = np.array([noisy_count(1000, eps, seed=s, minimum=0) for s in range(6000)]) - 1000
    a = math.exp(-eps)
    assert abs(draws.mean()) < 0.15  # E[Z] = 0; sd of the mean ~ 0.035
    assert draws.var() == pytest.approx(2 * a / (1 - a) ** 2, rel=0.1)
    # P(Z = 0) = (1 - a) / (1 + a)
    assert np.mean(draws == 0) == pytest.approx((1 - a) / (1 + a), abs=0.02)
    assert noisy_count(0, 0.1, seed=1) >= 1 and noisy_count(5, 2.0, seed=3) == noisy_count(5, 2.0, seed=3)
    with pytest.raises(ValueError):
        noisy_count(5, 0.0)


def test_ledger_sums_dp_releases_and_lists_uncovered_ones():
    led = ReleaseLedger("site-1")
    led.add_training({"accountant": "rdp", "epsilon": 7.9, "delta": 1e-3, "noise_multiplier": 0.8,
                      "sample_rate": 0.14, "steps": 35, "losses": "drop"})
    led.add("training-set size", "dp", epsilon=0.5, delta=0.0, mechanism="discrete Laplace")
    led.add("validation summaries", "not covered")
    led.add("threshold histogram", "k-anonymity", k=5)
    d = led.to_dict()
    assert d["dp_total"] == {"epsilon": pytest.approx(8.4), "delta": pytest.approx(1e-3)}
    assert d["not_covered"] == ["validation summaries"]
    assert [r["protection"] for r in d["releases"]] == ["dp", "dropped", "dp", "not covered", "k-anonymity"]
    with pytest.raises(ValueError, match="protection"):
        led.add("x", "encrypted")


# ------------------------------------------------------------------------------------------------ attacks
def test_auc_and_tpr_at_fpr_hand_cases():
    assert auc([3, 4], [1, 2]) == 1.0 and auc([1, 2], [3, 4]) == 0.0 and auc([1, 1], [1, 1]) == 0.5
    assert auc([1, 3], [2, 2]) == 0.5
    nonmembers = np.arange(100.0)                 # 1 % FPR allows 1 false positive: threshold 98
    assert tpr_at_fpr([99.5, 98.5, 98.0, 10], nonmembers, 0.01) == 0.5
    assert tpr_at_fpr([99.5, 98.5], np.arange(10.0), 0.01) == 1.0  # 0 allowed: threshold 9
    m = attack_metrics([3, 4, 5], [0, 1, 2], n_boot=50)
    assert m["auc"] == m["auc_low"] == m["auc_high"] == 1.0 and m["fpr_resolution"] == pytest.approx(1 / 3)


def _mlp_data(n, d=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, 2, (n,), generator=g)


def test_loss_threshold_attack_high_auc_on_a_memorising_model_and_chance_on_an_untrained_one():
    xin, yin = _mlp_data(64, seed=1)  # members: random 200-d inputs with random labels, nothing to generalise
    xout, yout = _mlp_data(64, seed=2)
    torch.manual_seed(0)
    memoriser = nn.Sequential(nn.Linear(200, 256), nn.ReLU(), nn.Linear(256, 2))
    untrained = nn.Sequential(nn.Linear(200, 256), nn.ReLU(), nn.Linear(256, 2))
    opt = torch.optim.Adam(memoriser.parameters(), lr=0.01)
    for _ in range(300):
        opt.zero_grad()
        nn.functional.cross_entropy(memoriser(xin), yin).backward()
        opt.step()
    results = {}
    for name, m in (("memorising", memoriser), ("untrained", untrained)):
        lin = per_example_losses(model_logits(m, xin), yin)
        lout = per_example_losses(model_logits(m, xout), yout)
        results[name] = loss_threshold_attack(lin, lout, n_boot=200, seed=0)
    mem, unt = results["memorising"], results["untrained"]
    assert mem["auc"] > 0.95 and mem["auc_low"] > 0.9 and mem["tpr_at_fpr"] > 0.5
    assert abs(unt["auc"] - 0.5) < 0.12 and unt["auc_low"] < 0.5 < unt["auc_high"]
    assert mem["roc"]["fpr"][0] == 0.0 and mem["roc"]["tpr"][-1] == 1.0


def test_lira_calibration_finds_members_a_global_threshold_misses():
    """Images differ in difficulty (mu_i spread 5 wide) far more than membership moves them (+1.5): a global
    threshold on phi is near chance, the per-image calibration of offline LiRA is not."""
    rng = np.random.default_rng(0)
    n, s = 400, 8
    mu = rng.normal(0, 5, n)
    member = np.arange(n) < n // 2
    shadows = mu + rng.normal(0, 1, (s, n))
    target = mu + rng.normal(0, 1, n) + 1.5 * member
    raw = auc(target[member], target[~member])
    scores = lira_offline(target, shadows)
    lira = auc(scores[member], scores[~member])
    assert raw < 0.65 and lira > 0.8
    assert auc(*(lambda sc: (sc[member], sc[~member]))(lira_offline(target, shadows, global_variance=False))) > 0.75
    with pytest.raises(ValueError, match="2 shadow"):
        lira_offline(target, shadows[:1])


def test_logit_confidence_is_the_log_odds_of_the_true_class():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    p = torch.softmax(logits.double(), 1)
    phi = logit_confidence(logits, [0, 2])
    assert phi == pytest.approx([math.log(p[0, 0] / (1 - p[0, 0])), math.log(1 / 2)])


def test_one_run_audit_p_value_hand_case_and_validity_on_randomised_response():
    from scipy.stats import binom

    # delta = 0: the p-value is the binomial tail; at eps = 0, q = 1/2
    assert audit_p_value(10, 2, 2, 0.0, 0.0) == pytest.approx(0.25)
    assert audit_p_value(50, 20, 15, 1.0, 0.0) == pytest.approx(binom.sf(14, 20, math.e / (1 + math.e)))
    assert audit_p_value(50, 20, 15, 1.0, 1e-3) > audit_p_value(50, 20, 15, 1.0, 0.0)
    # every guess right on 20 guesses: the bound solves (e^eps / (1 + e^eps))^20 = 0.05
    q = 0.05 ** (1 / 20)
    assert epsilon_lower_bound(100, 20, 20, 0.0) == pytest.approx(math.log(q / (1 - q)), rel=1e-6)
    assert epsilon_lower_bound(100, 20, 10, 0.0) == 0.0
    # randomised response at eps = 1 is exactly 1-DP: the 95 % lower bound exceeds 1 in at most ~5 % of audits
    rng = np.random.default_rng(0)
    eps_true, m, over = 1.0, 200, 0
    for _ in range(200):
        inc = rng.random(m) < 0.5
        keep = rng.random(m) < math.e / (1 + math.e)
        scores = np.where(inc == keep, 1.0, -1.0) + 1e-3 * rng.random(m)  # the mechanism's output only
        res = one_run_audit(scores, inc, 40, 40, delta=0.0)
        over += res["epsilon_lower_bound"] > eps_true
    assert over <= 20  # binomial(200, 0.05) rarely exceeds 20
    big = one_run_audit(np.where(inc, 1.0, -1.0), inc, 40, 40, delta=1e-5)  # a mechanism that reveals everything
    assert big["correct"] == 80 and big["epsilon_lower_bound"] > 2.5


# ------------------------------------------------------------------------------------------------ server stage
def test_server_stage_needs_no_site_images(monkeypatch):
    """Fusion, distillation on public probe tensors and FedAvg's average run on uploaded state dicts and probe
    tensors alone: with every way of reading an image or iterating a data loader disabled, they still run, so what
    the server makes of DP uploads is post-processing."""
    import PIL.Image

    import chest_xray.io
    import chest_xray.transforms
    from hfl_components.aggregation import weighted_average
    from hfl_components.fusion import aggregate_models
    from hfl_components.fusion.distill import DistillConfig, Teacher, distill
    from hfl_components.models.fusable import build_fusable

    def no_images(*a, **k):
        raise AssertionError("the server stage touched site images")

    for mod, name in ((chest_xray.io, "read_image"), (chest_xray.transforms, "make_site_dataset"),
                      (PIL.Image, "open"), (DataLoader, "__iter__")):
        if hasattr(mod, name):
            monkeypatch.setattr(mod, name, no_images)
    base = {"family": "cnn", "width": 0.1, "in_channels": 1, "num_classes": 2}
    uploads = []
    for i, depth in enumerate(("shallow", "shallow", "medium")):
        torch.manual_seed(i)
        spec = {**base, "depth": depth}
        uploads.append({"name": f"site-{i + 1}", "spec": spec, "state_dict": build_fusable(spec).state_dict(),
                        "n_samples": 50 + 10 * i, "val_acc": 0.7})
    probe = torch.rand(16, 1, 16, 16, generator=torch.Generator().manual_seed(0))  # public probe tensor
    spec, state, _ = aggregate_models(uploads, "cid", probe=probe)
    student = build_fusable(spec)
    student.load_state_dict(state)
    teachers = []
    for u in uploads:
        m = build_fusable(u["spec"])
        m.load_state_dict(u["state_dict"])
        teachers.append(Teacher(u["name"], m, 16))
    res = distill(student, [16], teachers, {16: probe}, config=DistillConfig(steps=4, batch_size=8, eval_every=2,
                                                                              patience=0))
    assert res.steps_run == 4
    same = [{k: v.numpy() for k, v in u["state_dict"].items()} for u in uploads[:2]]
    avg = weighted_average(same, [50, 60])
    k = next(iter(avg))
    assert np.allclose(avg[k], (50 * same[0][k] + 60 * same[1][k]) / 110, atol=1e-6)


class _InplaceResidual(nn.Module):
    """A residual block written as MONAI's ResNet writes it: ``out += residual`` on a hooked layer's output."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 3, padding=1)
        self.fc = nn.Linear(1, 2)

    def features(self, x):
        out = self.conv(x)
        out += x
        return out.mean(dim=(2, 3))

    def head(self, z):
        return self.fc(z)


def test_compatibility_trial_step_finds_an_in_place_residual_add():
    _, report = make_compatible(_InplaceResidual(), input_size=8)
    assert report["remaining"] and report["text"].startswith("dp: NOT trainable with DP-SGD (Opacus): a trial step")
    inplace_relu = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    fixed, report = make_compatible(inplace_relu, input_size=8)
    assert report["inplace_off"] == 1 and not report["remaining"] and fixed[1].inplace is False


def test_fens_aggregator_trains_under_dp_within_its_budget():
    from hfl_components.models.ensemble import Aggregator
    from hfl_components.training.aggregator import train_aggregator

    g = torch.Generator().manual_seed(0)
    z = torch.log_softmax(torch.randn(30, 3, 2, generator=g), dim=2)  # 30 hold-out rows, 3 members, 2 classes
    y = torch.randint(0, 2, (30,), generator=g)
    plan = check_budget(30, 10, 2, DPSpec(epsilon=4, accountant="rdp"), "site-2")
    session = DPSession(plan, seed=0)
    torch.manual_seed(0)
    agg = Aggregator(3, 2)
    before = [p.detach().clone() for p in agg.parameters()]
    hist = train_aggregator(agg, z, y, 2, batch_size=10, dp=session)
    assert hist == [{"epoch": 1, "loss": None, "dp": True}, {"epoch": 2, "loss": None, "dp": True}]
    rec = session.record()
    assert rec["steps"] == plan.steps == 6 and rec["epsilon"] <= 4.0
    assert any(not torch.equal(a, p) for a, p in zip(before, agg.parameters()))
