"""One source of per-method defaults (hfl_components.flare.catalogue): the simulator, compare's epoch budgets and a
site config that leaves the epochs out all train the same number of epochs."""
from __future__ import annotations

import argparse

import pytest
import yaml

from hfl_components.flare.catalogue import method_defaults, methods


def _site_cfg(tmp_path, **extra):
    from hfl_components.flare.site_config import load_site_config

    manifest = tmp_path / "m.csv"
    manifest.write_text("path,label,split\n")
    raw = {"data": {"manifest": str(manifest), "labels": "binary"}, "model": {"family": "cnn", "depth": "shallow"},
           **extra}
    p = tmp_path / "site-1.yaml"
    p.write_text(yaml.safe_dump(raw))
    return load_site_config("site-1", p)


class _RT:
    def __init__(self, cfg, method):
        self.cfg, self.method, self.site = cfg, method, "site-1"
        self.method_defaults = method_defaults(method) if method else None  # what dispatch.handler sets


def _simulate_args(method: str):
    from nvflare_jobs.commands.simulate import cli_spec
    from nvflare_jobs.spec import resolve

    args = cli_spec(["--method", method])
    lib = resolve(method, {})  # the library's defaults are the command line's
    assert lib == args
    return args


@pytest.mark.parametrize("method", methods())
def test_site_config_defaults_agree_with_simulate(tmp_path, method):
    """A hand-written site config without epochs trains what `cxr-hfl simulate` trains (OHFL: 20 + 10, not 2 + 2)."""
    from hfl_components.flare.site_methods import task_epochs as _epochs

    args = _simulate_args(method)
    cfg = _site_cfg(tmp_path)
    rt = _RT(cfg, method)
    assert _epochs(rt, {}, "local_epochs", "local_epochs") == args.site_epochs[0]
    assert _epochs(rt, {}, "finetune_epochs", "finetune_epochs") == args.site_epochs[1]
    d = method_defaults(method)
    assert (args.labels, args.rounds) == (d["labels"], d["rounds"])
    assert args.site_epochs == (d["local_epochs"], d["finetune_epochs"])


def test_ohfl_defaults_are_the_simulators_and_explicit_values_win(tmp_path):
    from hfl_components.flare.site_methods import task_epochs as _epochs

    assert (method_defaults("ohfl")["local_epochs"], method_defaults("ohfl")["finetune_epochs"]) == (20, 10)
    rt = _RT(_site_cfg(tmp_path, local_epochs=4), "ohfl")
    assert _epochs(rt, {}, "local_epochs", "local_epochs") == 4  # the hospital's own value
    assert _epochs(rt, {"local_epochs": 1}, "local_epochs", "local_epochs") == 1  # the job's value
    with pytest.raises(ValueError, match="site site-1: local_epochs"):
        _epochs(_RT(_site_cfg(tmp_path), None), {}, "local_epochs", "local_epochs")


def test_compare_epoch_plan_reads_the_same_defaults():
    from nvflare_jobs.compare import CompareOptions, epoch_plan

    ohfl = method_defaults("ohfl")
    for unequal in (False, True):
        args = CompareOptions(out="runs/x", unequal_budgets=unequal)
        assert epoch_plan("ohfl", args)["local_epochs"] == ohfl["local_epochs"]
        assert epoch_plan("ohfl", args)["finetune_epochs"] == ohfl["finetune_epochs"]
    # unequal budgets: each method runs the simulator's own defaults
    args = CompareOptions(out="runs/x", unequal_budgets=True)
    for m in ("fedavg", "fedsaf", "fedtopo"):
        plan = epoch_plan(m, args)
        assert (plan["rounds"], plan["local_epochs"]) == (method_defaults(m)["rounds"], method_defaults(m)["local_epochs"])
    # equal budgets (compare's default): every method trains OHFL's local + fine-tuning epochs per site
    args = CompareOptions(out="runs/x", unequal_budgets=False)
    for m in ("local", "fedavg", "fedsaf", "fedtopo"):
        assert epoch_plan(m, args)["total_epochs_per_site"] == ohfl["local_epochs"] + ohfl["finetune_epochs"]
