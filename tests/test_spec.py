"""The run spec (``nvflare_jobs.spec``): options resolved once, from declarations only, checked before anything is
written; the command line's spec equals the library's; errors name the option key and only the CLI names flags; a
run's outcome read back as a ``Run``. The simulator itself runs in the slow tests and ``cxr-hfl compare`` (which
calls ``RunSpec.simulate(..., isolate=True)``)."""
from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from hfl_components.flare import catalogue
from nvflare_jobs.runner import Run, finished
from nvflare_jobs.runner import SimulateError
from nvflare_jobs.spec import RUN_OPTIONS, cli_message, from_dict, resolve


def test_the_command_lines_spec_is_the_librarys():
    from nvflare_jobs.commands.simulate import cli_spec

    for method in catalogue.methods():
        assert cli_spec(["--method", method]) == resolve(method, {}), method
    # given flags and given keys resolve alike
    assert cli_spec(["--method", "fedtopo", "--rounds", "4", "--lambda", "0.5"]) == resolve(
        "fedtopo", {"rounds": 4, "lam": 0.5})


def test_defaults_come_from_the_declarations_only():
    """Every run option's default is RUN_OPTIONS'; a method's labels, rounds, input sizes and options are its
    catalogue entry's (nothing restated between the declaration and the spec)."""
    for method, e in catalogue.CATALOGUE.items():
        s = resolve(method)
        for o in RUN_OPTIONS:
            if o.key not in ("labels", "rounds", "input_sizes"):
                assert getattr(s, o.key) == o.default, (method, o.key)
        assert (s.labels, s.rounds, s.input_sizes) == (e.labels, e.rounds, tuple(e.input_sizes))
        assert dict(s.options) == {o.key: (o.fixed if o.has_fixed else o.default) for o in e.options}
        assert s.site_epochs == (e.local_epochs, e.finetune_epochs)


def test_the_spec_is_frozen_and_round_trips():
    s = resolve("ohfl", {"paper": True, "seed": 3, "input_sizes": "32,48"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.seed = 4
    with pytest.raises(TypeError):
        s.options["ot"] = "emd"
    assert s.input_sizes == (32, 48) and s.ot == "sinkhorn" and s.finetune_epochs == 50
    assert from_dict(json.loads(json.dumps(s.to_dict()))) == s
    assert s.replace(seed=5).seed == 5 and s.replace(seed=5).ot == "sinkhorn"
    with pytest.raises(AttributeError, match="no option 'lam'"):
        s.lam


def test_check_types_text_options_and_names_the_bad_one():
    got = resolve("fedtopo", {"rounds": "4", "lam": "0.5", "ablate": ["no_ema"]})
    assert (got.rounds, got.lam, got.ablate) == (4, 0.5, ["no_ema"])
    with pytest.raises(SimulateError, match=r"unknown option\(s\) \['bogus'\] for fedavg"):
        resolve("fedavg", {"bogus": 1})
    with pytest.raises(SimulateError, match=r"fedtopo: option 'rho' \(--rho\): rho must lie in \[0, 1\)") as e:
        resolve("fedtopo", {"rho": 1.5})
    assert e.value.key == "rho"
    with pytest.raises(SimulateError, match="option 'paper' is a preset of ohfl") as e:
        resolve("fedavg", {"paper": True})
    assert e.value.key == "paper"
    with pytest.raises(SimulateError, match="unknown method 'fedfoo'"):
        resolve("fedfoo", {})


def test_library_errors_name_keys_and_the_cli_names_flags():
    """A library caller reads ``option 'late_wait'``; the command line shows the same error as ``--late-wait``."""
    with pytest.raises(SimulateError) as e:
        resolve("fedavg", {"late_wait": -1})
    assert e.value.key == "late_wait" and "--" not in str(e.value) and "option 'late_wait'" in str(e.value)
    assert cli_message(e.value).startswith("--late-wait: must be an integer >= 0")
    with pytest.raises(SimulateError) as e:
        resolve("fedtopo", {"lam": -1})
    assert cli_message(e.value) == str(e.value)  # the catalogue's own message already shows both


def test_simulate_refuses_bad_options_before_writing(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(SimulateError, match="option 'mu'"):
        resolve("fedprox", {"mu": -1}).simulate(out)
    assert not out.exists()


def test_finished_reads_the_run_back(tmp_path):
    assert finished("fedavg", tmp_path, 1) == Run(tmp_path, "fedavg", 1, None, None)
    assert not finished("fedavg", tmp_path, 0).ok
    (tmp_path / "metrics.json").write_text(json.dumps({"method": "fedavg"}))
    run = finished("fedavg", tmp_path, 0)
    assert run.ok and run.metrics == {"method": "fedavg"}


@pytest.mark.parametrize("key, value", [("rounds", 0), ("rounds", -2), ("finetune_epochs", -1), ("local_epochs", -1),
                                        ("batch_size", 0), ("seed", -1), ("min_sites", 0)])
def test_the_library_refuses_what_the_command_line_refuses(tmp_path, key, value):
    """``simulate --rounds 0`` / ``--finetune-epochs -1`` are refused by the command line; the library (what compare
    calls for a variant such as ``fedavg:rounds=0``) refuses the same values, typed or as text, before anything is
    written."""
    from nvflare_jobs.commands.simulate import _add_method_args

    p = argparse.ArgumentParser()
    _add_method_args(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--method", "fedavg", "--" + key.replace("_", "-"), str(value)])
    for v in (value, str(value)):
        with pytest.raises(SimulateError, match=rf"option '{key}': must be an integer >= \d+, got {value}"):
            resolve("fedavg", {key: v})
    out = tmp_path / "run"
    with pytest.raises(SimulateError):
        resolve("fedavg", {key: value}).simulate(out)
    assert not out.exists()
    least = int(str(p.parse_args(["--method", "fedavg", "--" + key.replace("_", "-"), str(value + 5)]).__dict__[key]))
    assert getattr(resolve("fedavg", {key: least}), key) == least  # a value the command line takes passes


def test_no_library_module_exits_or_parses_a_command_line():
    """Only the CLI (``nvflare_jobs/cli.py``, ``nvflare_jobs/commands/``) imports argparse, calls ``sys.exit`` or
    raises ``SystemExit``; ``__main__`` blocks of scripts are the listed exception (judged on the syntax tree)."""
    import ast
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    files = subprocess.run(["git", "ls-files", "chest_xray/*.py", "hfl_components/*.py", "nvflare_jobs/*.py"],
                           cwd=repo, capture_output=True, text=True).stdout.split()
    bad = []
    for f in files:
        if f == "nvflare_jobs/cli.py" or f.startswith("nvflare_jobs/commands/"):
            continue
        tree = ast.parse((repo / f).read_text())
        main_blocks = {id(n) for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
                       for n in ast.walk(node)}
        for n in ast.walk(tree):
            if id(n) in main_blocks:
                continue
            if isinstance(n, ast.Import) and any(a.name == "argparse" for a in n.names) or \
                    isinstance(n, ast.ImportFrom) and n.module == "argparse":
                bad.append(f"{f}:{n.lineno} imports argparse")
            elif isinstance(n, ast.Call) and ast.unparse(n.func) in ("sys.exit", "exit"):
                bad.append(f"{f}:{n.lineno} calls sys.exit")
            elif isinstance(n, ast.Raise) and n.exc is not None and "SystemExit" in ast.unparse(n.exc):
                bad.append(f"{f}:{n.lineno} raises SystemExit")
    assert not bad, "\n".join(bad)


def test_augment_reaches_every_generated_site_config_and_a_profile_keeps_its_own(tmp_path):
    """``augment`` is a run option (border augmentation for a study or a whole consortium): resolve checks it
    against the site config's values and names the key; compare's pass-through writes it into every site config of
    every method; ``simulate --profile`` with ``--augment`` is refused (the profile's site configs decide it)."""
    import yaml

    from hfl_components.flare.site_config import AUGMENTS
    from nvflare_jobs.compare import CompareOptions, write_method_profile
    from tests.sim_helpers import run_cli

    assert resolve("ohfl", {"augment": "border"}).augment == "border" and resolve("ohfl", {}).augment is None
    with pytest.raises(SimulateError) as e:
        resolve("fedavg", {"augment": "stripes"})
    assert e.value.key == "augment" and all(a in str(e.value) for a in AUGMENTS)
    part = tmp_path / "part"
    (part / "sites").mkdir(parents=True)
    for i in range(1, 4):
        (part / "sites" / f"site-{i}.csv").write_text("path,label,split\n")
    for method in ("ohfl", "fedavg", "local"):
        prof = write_method_profile(part, tmp_path / method, method, 0, CompareOptions(out="x", augment="border"))
        assert {yaml.safe_load(f.read_text())["augment"] for f in prof.glob("site-*.yaml")} == {"border"}
    prof = write_method_profile(part, tmp_path / "plain", "fedavg", 0, CompareOptions(out="x"))
    assert all("augment" not in yaml.safe_load(f.read_text()) for f in prof.glob("site-*.yaml"))
    r = run_cli("simulate", "--method", "fedavg", "--profile", str(tmp_path / "ohfl" / "site_configs"),
                "--augment", "border", "--out", str(tmp_path / "run"), timeout=120)
    assert r.returncode == 2 and "--augment border: with --profile each site config's augment: key decides it" \
        in r.stderr and not (tmp_path / "run").exists()
