"""Bad input a hospital user types, found by a fresh reading of the README: each is refused with one line naming
the file or option (exit 2), no traceback, and nothing is left half-written that a corrected rerun would trip
over. In-process through the CLI's ``main`` (the same parsers and handlers as ``cxr-hfl``); no training."""
from __future__ import annotations

import pytest

from nvflare_jobs.cli import main
from tests.cli_helpers import one_line


def _usage_error(capsys, argv, *says) -> str:
    """argparse's refusal: exit 2, its last stderr line names the option."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    for s in says:
        assert s in last, last
    return last


_one_line = one_line


@pytest.mark.parametrize("argv", (
    ["simulate", "--method", "ohfl", "--seed", "-1"],
    ["partition", "--data", "D", "--sites", "2", "--seed", "-1"],
    ["compare", "--seeds", "0,-1"],
))
def test_a_negative_seed_is_refused_naming_the_option(tmp_path, capsys, argv):
    """numpy takes no negative seed: it used to fail later with "expected non-negative integer", naming no option,
    after the run folder was made."""
    out = tmp_path / "out"
    _usage_error(capsys, [*argv, "--out", str(out)], "--seed")
    assert not out.exists()


@pytest.mark.parametrize("argv", (
    ["simulate", "--method", "ohfl", "--input-sizes", "64,100000"],
    ["compare", "--input-sizes", "32,2048"],
))
def test_an_input_size_above_what_a_site_accepts_is_refused_at_the_command_line(tmp_path, capsys, argv):
    """A site config takes input_size 16..1024 px: 100000 used to pass the command line, partition the data and
    write site configs, then fail in three lines naming generated files, leaving a folder the rerun refused."""
    out = tmp_path / "out"
    _usage_error(capsys, [*argv, "--out", str(out)], "--input-sizes", "16 to 1024")
    assert not out.exists()


@pytest.mark.parametrize("dim", ("0", "-3"))
def test_a_feature_dimension_below_one_is_refused(tmp_path, capsys, dim):
    """--feature-dim 0 used to pass; the sites' backbones would only fail inside the simulator."""
    out = tmp_path / "out"
    _usage_error(capsys, ["simulate", "--method", "fedsaf", "--feature-dim", dim, "--out", str(out)],
                 "--feature-dim", ">= 1")
    assert not out.exists()


@pytest.mark.parametrize("option, value", (
    ("--rounds", "0"), ("--rounds", "-2"), ("--late-wait", "-1"), ("--max-train-images", "-1"),
    ("--batch-size", "0"), ("--max-images", "0"), ("--max-images", "-5"),
))
def test_compare_refuses_out_of_range_pass_through_numbers(tmp_path, capsys, option, value):
    """These used to be dropped silently (0 is false: --batch-size 0, --max-images 0, --rounds 0) or passed on to
    every run (--late-wait -1); compare --dry-run even wrote its folder first."""
    out = tmp_path / "cmp"
    _usage_error(capsys, ["compare", "--dry-run", option, value, "--out", str(out)], f"argument {option}", value)
    assert not out.exists()


def test_compare_help_shows_the_default_of_every_option(capsys):
    """README: `cxr-hfl <command> --help` lists every option with its default; compare's --sites, --scheme,
    --alpha, --rounds, --late-wait, --batch-size, ... said none."""
    assert not _options_without_default("compare")


def _options_without_default(only: str | None = None) -> list[str]:
    """``"<command> <option>"`` for every option of every (nested) subcommand whose help names no default (but
    required options and on/off flags)."""
    import argparse
    import re

    from nvflare_jobs.cli import build_parser

    lacking = []

    def walk(p, name):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for n, sp in a.choices.items():
                    walk(sp, f"{name} {n}".strip())
            elif (a.option_strings and not (a.required or a.nargs == 0 or a.default == argparse.SUPPRESS)
                  and not re.search(r"(?i)\bdefault\b", a.help or "")):
                lacking.append(f"{name} {a.option_strings[0]}")
    walk(build_parser(), "")
    return [x for x in lacking if only is None or x.split()[0] == only]


def test_every_commands_help_shows_the_default_of_every_option():
    """The README's promise, for every command: poc start --timeout, poc submit / results --wait, evaluate --part
    and --max-images, audit --part, site check --json and --startup-kit said none."""
    assert not _options_without_default(), _options_without_default()


def _tiny_data(root):
    """24 small grey PNGs of different widths in NORMAL/ and PNEUMONIA/ (a data root of the class-folder layout;
    the refusals tested here come before any image is trained on)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(24):
        cls = ("NORMAL", "PNEUMONIA")[i % 2]
        (root / cls).mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (40, 40 + i), dtype=np.uint8)).save(root / cls / f"IM-{i:04d}-0001.png")
    return root


def test_a_simulate_refused_after_partitioning_leaves_no_folder_and_the_rerun_says_the_same(tmp_path, capsys):
    """OHFL without a probe on data that has none beside it is refused only after the data are partitioned; the
    partition and site configs it had written made the corrected rerun fail with "already holds a run
    (unfinished ...)": now the refusal removes them, and the same command is refused the same way again."""
    data, out = _tiny_data(tmp_path / "data"), tmp_path / "run"
    argv = ["simulate", "--method", "ohfl", "--data", str(data), "--sites", "2", "--out", str(out)]
    for _ in range(2):
        assert main(argv) == 2
        _one_line(capsys, "OHFL needs a public probe set", "--probe")
        assert not out.exists()
    out.mkdir()  # a folder the user made: kept, emptied of what the run wrote
    (out / "notes.txt").write_text("mine")
    assert main(argv) == 2
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_more_min_sites_than_sites_is_refused_before_anything_runs(tmp_path, capsys):
    """--min-sites 10 with 3 sites used to partition, start NVFlare and fail as a whole run (exit 1)."""
    out = tmp_path / "run"
    assert main(["simulate", "--method", "ohfl", "--data", str(_tiny_data(tmp_path / "data")), "--sites", "3",
                 "--min-sites", "10", "--out", str(out)]) == 2
    _one_line(capsys, "--min-sites 10", "3 sites")
    assert not out.exists()


def test_more_min_sites_than_a_profiles_sites_is_refused_before_the_simulator_starts(tmp_path, capsys):
    prof, out = tmp_path / "profile", tmp_path / "run"
    prof.mkdir()
    for s in ("hosp-a", "hosp-b"):
        (prof / f"{s}.yaml").write_text("data:\n  manifest: site.csv\nmodel: {family: cnn, depth: shallow}\n"
                                        "input_size: 32\n")
    assert main(["simulate", "--method", "ohfl", "--profile", str(prof), "--probe", "generated", "--min-sites", "3",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--min-sites 3: more than the profile's 2 sites" in err[-1] and "Traceback" not in "".join(err)
    assert not out.exists()


def test_a_log_config_that_is_neither_a_mode_nor_a_file_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    _usage_error(capsys, ["simulate", "--method", "ohfl", "--log-config", str(tmp_path / "nope.json"),
                          "--out", str(out)], "--log-config", "nope.json", "no such file")
    assert not out.exists()
    from nvflare_jobs.commands.simulate import _log_config

    cfg = tmp_path / "log.json"
    cfg.write_text("{}")
    assert _log_config("concise") == "concise" and _log_config(str(cfg)) == str(cfg.resolve())


def test_simulate_help_gives_one_default_for_the_probe(capsys):
    """--help said "(default: ../shared/data/chest_xray_224 beside chest_xray_original) (default: none)"."""
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    probe = text.split("--probe PROBE [ohfl]", 1)[1].split("--probe-size")[0]
    assert probe.count("default") == 1 and "(default: none)" not in probe, probe
    assert "probe part" in probe


def _evaluated_run(tmp_path):
    ext = tmp_path / "run" / "external" / "set"
    ext.mkdir(parents=True)
    return tmp_path / "run", ext


def test_audit_of_a_truncated_predictions_file_is_one_line_naming_it(tmp_path, capsys):
    """A predictions.npz cut short (disk full, an interrupted copy) gave a zipfile traceback and exit 1."""
    import numpy as np

    run, ext = _evaluated_run(tmp_path)
    np.savez(ext / "predictions.npz", paths=np.array(["a.png", "b.png"]), y=np.array([0, 1]),
             m=np.array([[0.9, 0.1], [0.2, 0.8]]))
    whole = (ext / "predictions.npz").read_bytes()
    (ext / "predictions.npz").write_bytes(whole[: len(whole) // 2])
    assert main(["audit", "--run", str(run)]) == 2
    _one_line(capsys, "predictions.npz", "unreadable", "--overwrite")


def test_audit_with_a_truncated_summary_names_the_file(tmp_path, capsys):
    """It said only "error: Expecting value: line 2 column 1 (char 6)"."""
    import numpy as np

    run, ext = _evaluated_run(tmp_path)
    np.savez(ext / "predictions.npz", paths=np.array(["a.png", "b.png"]), y=np.array([0, 1]),
             m=np.array([[0.9, 0.1], [0.2, 0.8]]))
    (ext / "summary.json").write_text('{"x":\n')
    assert main(["audit", "--run", str(run)]) == 2
    _one_line(capsys, str(ext / "summary.json"), "not readable as JSON")
    assert not (ext / "audit.json").exists()


def test_partition_of_a_manifest_with_a_header_and_no_rows_names_it(tmp_path, capsys):
    """It said only "no records to partition"."""
    csv_file, out = tmp_path / "manifest.csv", tmp_path / "part"
    csv_file.write_text("path,label\n\n")
    assert main(["partition", "--data", str(csv_file), "--sites", "2", "--out", str(out)]) == 2
    _one_line(capsys, str(csv_file), "no usable images")
    assert not out.exists()


@pytest.mark.parametrize("argv, says", (
    (["--scheme", "dirichlet", "--min-per-site", "-3"], ["argument --min-per-site", "-3"]),
))
def test_partition_refuses_a_negative_minimum_per_site(tmp_path, capsys, argv, says):
    """--min-per-site -3 was taken silently."""
    _usage_error(capsys, ["partition", "--data", "D", "--sites", "2", *argv, "--out", str(tmp_path / "p")], *says)


def test_an_infinite_dirichlet_alpha_is_refused_naming_it(tmp_path, capsys):
    """--alpha inf passed the > 0 check and failed after the scan with "raise alpha"."""
    out = tmp_path / "p"
    assert main(["partition", "--data", str(tmp_path / "D"), "--sites", "2", "--scheme", "dirichlet",
                 "--alpha", "inf", "--out", str(out)]) == 2
    _one_line(capsys, "--alpha", "finite", "inf")
    assert not out.exists()


def test_status_says_when_a_model_file_listed_in_models_json_is_missing(tmp_path, capsys):
    """A run folder copied in part (or a model deleted): status said "models: 2 files" and all was well, while
    evaluate then refused the run."""
    import json

    run = tmp_path / "run"
    (run / "models").mkdir(parents=True)
    (run / "metrics.json").write_text(json.dumps({"method": "ohfl", "sites": {"site-1": {}}}))
    (run / "models" / "site-1_deployed.pt").write_bytes(b"x")
    (run / "models.json").write_text(json.dumps({"models": [
        {"name": "site-1_deployed", "file": "models/site-1_deployed.pt"},
        {"name": "global", "file": "global_model.pt"}]}))
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert "MISSING: 1 model file(s) listed in models.json: global_model.pt" in out, out
    (run / "models.json").write_text('{"models": [')
    assert main(["status", str(run)]) == 0
    assert "models.json: unreadable" in capsys.readouterr().out


def test_audit_refuses_an_unknown_device_naming_the_option(tmp_path, capsys):
    """It said "error: must be one of auto | cpu | cuda | cuda:N, got 'foo'", naming no option, after the run
    folder and its evaluated set were looked up."""
    _usage_error(capsys, ["audit", "--run", str(tmp_path), "--device", "foo"], "argument --device", "'foo'")


@pytest.mark.parametrize("text, says", (
    (None, "does not exist"),
    ("participants: [\n", "not valid YAML (line 2"),
    ("api_version: 2\n", "needs api_version: 3"),
))
def test_provision_refuses_a_bad_project_file_in_one_line_exit_2(tmp_path, capsys, text, says):
    """A malformed project.yml gave a yaml traceback (exit 1); a missing one exited 1, which the README keeps for
    a command that ran but failed its purpose."""
    proj, out = tmp_path / "project.yml", tmp_path / "kits"
    if text is not None:
        proj.write_text(text)
    assert main(["provision", "--project", str(proj), "--out", str(out)]) == 2
    _one_line(capsys, str(proj), says)
    assert not out.exists()


@pytest.mark.parametrize("bad", ("probe", "root"))
def test_overwrite_with_a_refused_command_keeps_the_earlier_run(tmp_path, capsys, bad):
    """`simulate --overwrite` deleted the finished run first and was then refused (a data folder of no known
    layout; OHFL without a probe): the run was lost to a typo. It is now put back as it was."""
    import json

    out = tmp_path / "run"
    (out / "models").mkdir(parents=True)
    (out / "metrics.json").write_text(json.dumps({"method": "ohfl"}))
    (out / "models" / "site-1_deployed.pt").write_bytes(b"weights")
    (out / "site_accuracy.png").write_bytes(b"png")
    (out / "my_notes.txt").write_text("mine")
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    data = _tiny_data(tmp_path / "data") if bad == "probe" else tmp_path / "no_layout"
    (tmp_path / "no_layout").mkdir()
    assert main(["simulate", "--method", "ohfl", "--data", str(data), "--sites", "2", "--overwrite",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert ("OHFL needs a public probe set" if bad == "probe" else "unrecognised data root") in err, err
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "models", "my_notes.txt", "site_accuracy.png"]


def test_inspect_names_a_site_manifest_missing_from_a_partition_folder(tmp_path, capsys):
    """A partition folder copied in part: inspect showed the sites that were left, as if the partition had them
    all (exit 0); a truncated partition.json was reported without naming it."""
    import json

    out = tmp_path / "part"
    (out / "sites").mkdir(parents=True)
    (out / "partition.json").write_text(json.dumps({"scheme": "dirichlet", "class_names": ["NORMAL", "PNEUMONIA"],
                                                    "sites": {"site-1": {}, "site-2": {}}}))
    (out / "sites" / "site-1.csv").write_text("path,label,split\na.png,0,train\n")
    assert main(["inspect", str(out)]) == 2
    _one_line(capsys, str(out / "sites" / "site-2.csv"), "missing", "site-2")
    (out / "partition.json").write_text('{"scheme": ')
    assert main(["inspect", str(out)]) == 2
    _one_line(capsys, str(out / "partition.json"), "not readable as JSON")


@pytest.mark.parametrize("argv", (
    ["poc", "start", "--timeout", "0"], ["poc", "submit", "--job", "J", "--wait", "-5"],
    ["poc", "download", "--wait", "-1"], ["results", "7", "--out", "R", "--wait", "-1"],
))
def test_negative_waits_and_timeouts_are_refused_naming_the_option(capsys, argv):
    _usage_error(capsys, argv, "argument --" + argv[-2].lstrip("-"))


def test_an_out_path_through_a_file_is_named_in_plain_words(tmp_path, capsys):
    """simulate said "[Errno 17] File exists: ..." and report "afile: File exists" (after rendering the report)."""
    f = tmp_path / "afile"
    f.write_text("mine")
    assert main(["simulate", "--method", "ohfl", "--data", str(tmp_path), "--out", str(f)]) == 2
    _one_line(capsys, f"--out {f} is a file, not a folder")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text("{}")
    assert main(["report", str(run), "--out", str(f / "r.html")]) == 2
    _one_line(capsys, f"--out {f / 'r.html'}: {f} is a file, not a folder")
    assert f.read_text() == "mine"


@pytest.mark.parametrize("steps, refused", (("300", True), ("0", False)))
def test_paper_with_distillation_steps_is_refused_not_silently_zeroed(tmp_path, capsys, steps, refused):
    """--paper --distill-steps 300 ran without distillation and said nothing: the paper's pipeline sets 0 steps,
    as it sets --ot sinkhorn, and a conflicting explicit value is refused as theirs are."""
    from nvflare_jobs.runner import SimulateError
    from nvflare_jobs.spec import resolve

    if refused:
        with pytest.raises(SimulateError, match=r"option 'distill_steps' 0\); drop option 'distill_steps' 300") as e:
            resolve("ohfl", {"paper": True, "distill_steps": int(steps)})
        assert e.value.key == "distill_steps"
    else:
        assert resolve("ohfl", {"paper": True, "distill_steps": 0}).distill_steps == 0


@pytest.mark.parametrize("damage", ('{"input_size": ', '{"input_size": "big"}', "[1, 2]"))
def test_a_damaged_resolved_site_config_is_named_not_skipped(tmp_path, damage):
    """A truncated resolved_configs/site-3.json was skipped: predict scored the run's global model at the other
    sites' largest size (48 px, not 64) and said that was the run's largest; evaluate's leakage check left out
    site-3's training manifest."""
    import json

    from nvflare_jobs.evaluation import run_input_sizes, run_manifests, run_site_sizes

    run = tmp_path / "run"
    (run / "resolved_configs").mkdir(parents=True)
    for site, size in (("site-1", 32), ("site-2", 48), ("site-3", 64)):
        man = tmp_path / f"{site}.csv"
        man.write_text("path,label,split\n")
        (run / "resolved_configs" / f"{site}.json").write_text(
            json.dumps({"input_size": size, "data": {"manifest": str(man)}}))
    assert run_input_sizes(run) == [32, 48, 64] and set(run_manifests(run)) == {"site-1", "site-2", "site-3"}
    (run / "resolved_configs" / "site-3.json").write_text(damage)
    for f in (run_input_sizes, run_site_sizes) + ((run_manifests,) if "big" not in damage else ()):
        with pytest.raises(ValueError, match="site-3.json"):
            f(run)


def test_status_of_a_run_whose_only_status_file_is_truncated_is_not_running(tmp_path, capsys):
    """It said "RUNNING" for a folder whose server status.json was cut short (the server writes it atomically)."""
    st = tmp_path / "run" / "workspace" / "server" / "simulate_job" / "cxr_hfl_results" / "status.json"
    st.parent.mkdir(parents=True)
    st.write_text('{"phase": "training", "task"')
    assert main(["status", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "RUNNING" not in out and "UNKNOWN" in out and str(st) in out, out


@pytest.mark.parametrize("probe", ("empty_folder", "csv_without_path"))
def test_a_probe_that_lists_no_images_is_refused_before_the_simulator_starts(tmp_path, capsys, probe):
    """An empty --probe folder partitioned the data, started NVFlare, trained every site and failed at the server
    (exit 3, 80 s on a laptop); a probe CSV without a path column was a KeyError at the server."""
    p = tmp_path / probe
    if probe == "empty_folder":
        p.mkdir()
    else:
        p = p.with_suffix(".csv")
        p.write_text("file,label\na.png,0\n")
    out = tmp_path / "run"
    assert main(["simulate", "--method", "ohfl", "--data", str(tmp_path), "--probe", str(p), "--out", str(out)]) == 2
    _one_line(capsys, str(p), "path column" if probe != "empty_folder" else "lists no images")
    assert not out.exists()


def test_a_probe_csv_with_a_bom_and_blank_lines_lists_its_images(tmp_path):
    from hfl_components.flare.probe import list_probe_files

    f = tmp_path / "probe.csv"
    f.write_text("path\n\na.png\n\nsub/b.png\n\n", encoding="utf-8-sig")
    assert list_probe_files(f) == [(tmp_path / "a.png").resolve(), (tmp_path / "sub" / "b.png").resolve()]


def test_evaluate_refuses_when_it_cannot_see_a_sites_training_manifest(tmp_path):
    """A run folder moved away from where it ran, its partition/ left behind: the leakage check found no training
    rows and scored the run's own training images as an external set (exit 0)."""
    import json

    from nvflare_jobs.evaluation.run_folder import LeakageError, missing_run_manifests
    from nvflare_jobs.evaluation.evaluate import _external_records

    data = _tiny_data(tmp_path / "data")
    train = sorted(data.rglob("*.png"))
    run = tmp_path / "run"
    (run / "resolved_configs").mkdir(parents=True)
    man = tmp_path / "elsewhere" / "site-1.csv"
    (run / "resolved_configs" / "site-1.json").write_text(json.dumps({"input_size": 32,
                                                                       "data": {"manifest": str(man)}}))
    with pytest.raises(FileNotFoundError, match=r"training manifest of site-1 .*--force"):
        _external_records(run, data, "binary", None, False, print)
    assert len(_external_records(run, data, "binary", None, True, lambda *_: None)[0]) == len(train)  # --force
    (run / "partition" / "sites").mkdir(parents=True)  # the copy beside the moved run folder is found
    (run / "partition" / "sites" / "site-1.csv").write_text(
        "path,label,split,patient_id\n" + "".join(f"{p},{int('PNEU' in str(p))},train,{p.stem}\n" for p in train))
    assert missing_run_manifests(run) == []
    with pytest.raises(LeakageError):
        _external_records(run, data, "binary", None, False, print)


def test_ctrl_c_before_the_simulator_starts_keeps_the_earlier_run_and_gives_no_overwrite_hint(
        tmp_path, capsys, monkeypatch):
    """Ctrl-C while the data were being scanned: the run that --overwrite was to replace is put back, and the
    message no longer says "rerun with --overwrite to replace the unfinished run" of a folder that holds none."""
    import json

    import nvflare_jobs.runner as runner

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "prepare_profile", interrupted)
    out = tmp_path / "run"
    (out / "workspace").mkdir(parents=True)
    (out / "metrics.json").write_text(json.dumps({"method": "ohfl"}))
    rc = main(["simulate", "--method", "ohfl", "--data", str(tmp_path), "--probe", "generated", "--overwrite",
               "--out", str(out)])
    assert rc == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "--overwrite" not in err, err
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "workspace"]


@pytest.mark.parametrize("probe", ("empty_folder", "missing"))
def test_compare_refuses_a_probe_that_lists_no_images_before_its_folder_is_made(tmp_path, capsys, probe):
    """Each OHFL run of the comparison failed on it in turn (compare then exited 1, 'rerun to retry')."""
    p = tmp_path / probe
    if probe == "empty_folder":
        p.mkdir()
    out = tmp_path / "cmp"
    assert main(["compare", "--methods", "local,ohfl", "--probe", str(p), "--dry-run", "--out", str(out)]) == 2
    _one_line(capsys, f"--probe {p}", "no images" if probe == "empty_folder" else "does not exist")
    assert not out.exists()


def test_a_site_config_with_zero_local_epochs_is_refused_naming_site_and_key():
    """``local_epochs: 0`` in a hospital's config would upload an untrained model (OHFL, FENS) or train nothing
    (every other method); 0 fine-tuning epochs stays allowed (deploy the global model as received)."""
    from hfl_components.flare.site_config import SiteConfigError, validate_site_config

    base = {"data": {"manifest": "x.csv"}, "model": {"family": "cnn", "depth": "shallow"}}
    with pytest.raises(SiteConfigError, match=r"site 'hosp-a'.*'local_epochs'.*>= 1, got 0"):
        validate_site_config({**base, "local_epochs": 0}, "hosp-a", check_files=False)
    assert validate_site_config({**base, "local_epochs": 1, "finetune_epochs": 0}, "hosp-a",
                                check_files=False)["finetune_epochs"] == 0
    with pytest.raises(SiteConfigError, match="'finetune_epochs'.*>= 0, got -1"):
        validate_site_config({**base, "finetune_epochs": -1}, "hosp-a", check_files=False)
