"""Command lines that used to run on silently (or print more than one line): each is refused with one line on
stderr naming what is wrong, exit 2, before anything is scanned or written. In-process through the CLI's
``main`` (the same parser and handlers as ``cxr-hfl``) so the tests stay fast."""
from __future__ import annotations

from pathlib import Path

import pytest

from nvflare_jobs.cli import main
from tests.cli_helpers import one_line


_one_line = one_line


def _pool_root(tmp_path: Path, parts=("tuning", "evaluation")) -> Path:
    """A folder laid out like the chest_xray_224 root holding the first two images (empty files) of each of
    ``parts``; the part check looks only at file names, never at pixels."""
    from chest_xray.splits import split_rows

    root = tmp_path / "chest_xray_224"
    for part in parts:
        for r in split_rows(part)[:2]:
            (root / r["path"]).parent.mkdir(parents=True, exist_ok=True)
            (root / r["path"]).write_bytes(b"")
    return root


def test_pool_root_needs_a_part_other_sets_do_not(tmp_path):
    """Two or more committed parts under a folder: it is the pool root and a part must be chosen; one part only,
    a CSV file, a missing path or a part given: no objection."""
    from nvflare_jobs.evaluation import part_required

    both = _pool_root(tmp_path / "a")
    why = part_required(both, None)
    assert why and "--part" in why and "tuning" in why and "evaluation" in why and "headline" in why
    assert "probe" not in why.split("(")[1].split(")")[0]  # only the parts that are there are listed
    assert part_required(both, "evaluation") is None
    assert part_required(_pool_root(tmp_path / "b", ("evaluation",)), None) is None
    csv_file = tmp_path / "ext.csv"
    csv_file.write_text("path,label\n")
    assert part_required(csv_file, None) is None
    assert part_required(tmp_path / "missing", None) is None
    assert "--external" in part_required(both, None, "--external")


def test_real_pool_root_needs_a_part(data_root):
    from nvflare_jobs.evaluation import part_required

    why = part_required(data_root / "chest_xray_224", None)
    assert why and all(p in why for p in ("probe", "tuning", "evaluation"))
    assert part_required(data_root / "chest_xray_original", None) is None


def test_evaluate_on_the_pool_root_without_part_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    root = _pool_root(tmp_path)
    assert main(["evaluate", "--run", str(run), "--data", str(root)]) == 2
    _one_line(capsys, "cxr-hfl evaluate:", str(root), "--part", "'evaluation' is for headline numbers")
    assert sorted(p.name for p in run.iterdir()) == []  # nothing written into the run


def test_compare_external_pool_root_without_part_is_refused_before_writing(tmp_path, capsys):
    out = tmp_path / "cmp"
    root = _pool_root(tmp_path)
    rc = main(["compare", "--methods", "local,fedavg", "--data", str(tmp_path / "no_data"), "--external", str(root),
               "--out", str(out), "--dry-run"])
    assert rc == 2
    _one_line(capsys, "--external", str(root), "--part")
    assert not out.exists()


def test_a_part_needs_a_data_folder_that_holds_it(tmp_path):
    """--part given: refused when the folder (or a CSV) holds none of that part's images, naming the option, the
    folder, the part and the pool root; fine when the pool root holds it, and left to the caller's own message when
    the path does not exist."""
    from nvflare_jobs.evaluation import part_required

    only_eval = _pool_root(tmp_path / "a", ("evaluation",))
    why = part_required(only_eval, "tuning", "--external")
    assert why == (f"--external {only_eval} holds none of the images of the committed 'tuning' part: --part needs "
                   "the chest_xray_224 root (e.g. ../shared/data/chest_xray_224)")
    assert part_required(only_eval, "evaluation") is None
    assert part_required(_pool_root(tmp_path / "b"), "tuning") is None
    csv_file = tmp_path / "ext.csv"
    csv_file.write_text("path,label\n")
    assert part_required(csv_file, "evaluation").startswith(f"--data {csv_file} holds none")
    assert part_required(tmp_path / "missing", "evaluation") is None


def test_audit_refuses_the_data_part_combinations_evaluate_refuses_with_the_same_line(tmp_path, capsys):
    """audit --data: the pool root without --part, a --part the folder does not hold, --part without --data: one
    line, exit 2, the same words as evaluate's refusal; nothing written into the run. A good combination gets as
    far as looking for the evaluated set's predictions."""
    run = tmp_path / "run"
    run.mkdir()
    root = _pool_root(tmp_path)
    only_eval = _pool_root(tmp_path / "e", ("evaluation",))
    for data, part in ((root, None), (only_eval, "tuning")):
        extra = ["--part", part] if part else []
        assert main(["evaluate", "--run", str(run), "--data", str(data), *extra]) == 2
        said = _one_line(capsys, "cxr-hfl evaluate: ", str(data), "--part").removeprefix("cxr-hfl evaluate: ")
        assert main(["audit", "--run", str(run), "--data", str(data), *extra]) == 2
        assert _one_line(capsys) == f"cxr-hfl audit: {said}"
    assert main(["audit", "--run", str(run), "--part", "evaluation"]) == 2
    _one_line(capsys, "cxr-hfl audit: --part evaluation needs --data", "chest_xray_224 root")
    assert sorted(p.name for p in run.iterdir()) == []
    assert main(["audit", "--run", str(run), "--data", str(root), "--part", "evaluation"]) == 2
    _one_line(capsys, str(run / "external" / "chest_xray_224-evaluation"), "no predictions.npz")


@pytest.mark.parametrize("exc, hint", [(ValueError("bad value in x.csv"), False),
                                       (FileNotFoundError(2, "No such file or directory", "x.csv"), False),
                                       (OSError(5, "Input/output error", "x.csv"), True)])
def test_generic_error_handler_prints_one_line(monkeypatch, capsys, tmp_path, exc, hint):
    """A ValueError / OSError a command lets through: exactly one line on stderr, exit 2; the traceback hint is in
    that line only for errors other than plain bad input; CXR_HFL_DEBUG=1 lets the exception through."""
    import nvflare_jobs.commands.evaluate as cmd

    def boom(args):
        raise exc

    monkeypatch.setattr(cmd, "run_report", boom)
    monkeypatch.delenv("CXR_HFL_DEBUG", raising=False)
    assert main(["report", str(tmp_path)]) == 2
    err = _one_line(capsys, "cxr-hfl report: error:", str(exc))
    assert ("CXR_HFL_DEBUG=1" in err) == hint, err
    monkeypatch.setenv("CXR_HFL_DEBUG", "1")
    with pytest.raises(type(exc)):
        main(["report", str(tmp_path)])


@pytest.mark.parametrize("name, text, says", [
    ("comparison.csv", "this is not,a table\nat all\n", "no column(s) method, seed, site"),
    ("comparison.csv", "method,seed,site,accuracy,balanced_accuracy,auc,sensitivity,specificity\n"
                       "local,zero,site-1,0.5,0.5,0.5,0.5,0.5\n", "line 2: seed 'zero'"),
    ("comparison.csv", "method,seed,site,accuracy,balanced_accuracy,auc,sensitivity,specificity\n"
                       "local,0,site-1,0.5,,high,0.5,0.5\n", "line 2: auc 'high'"),
    ("comparison_external.csv", "method,seed,model\nlocal,0,site-1_deployed\n", "no column(s) auc"),
])
def test_report_names_a_malformed_comparison_table(tmp_path, capsys, name, text, says):
    """A comparison folder whose table is not one compare wrote: one line naming the file, exit 2, no report."""
    cdir = tmp_path / "cmp"
    cdir.mkdir()
    good = "method,seed,site,accuracy,balanced_accuracy,auc,sensitivity,specificity\nlocal,0,site-1,1,1,,1,1\n"
    (cdir / "comparison.csv").write_text(good)
    (cdir / name).write_text(text)
    assert main(["report", str(cdir)]) == 2
    _one_line(capsys, str(cdir / name), says)
    assert not (cdir / "report.html").exists()


@pytest.mark.parametrize("families", ["", " ", ",,"])
@pytest.mark.parametrize("cmd", ["simulate", "compare"])
def test_empty_families_is_refused_not_read_as_the_default(tmp_path, capsys, families, cmd):
    """``--families ""`` used to mean cnn at every site without a word; now one line, nothing written."""
    out = tmp_path / "out"
    base = (["simulate", "--method", "ohfl"] if cmd == "simulate" else ["compare", "--methods", "local,fedavg",
                                                                         "--dry-run"])
    assert main([*base, "--families", families, "--data", str(tmp_path / "no_data"), "--out", str(out)]) == 2
    _one_line(capsys, "--families is empty", "6 sites")
    assert not out.exists()


def test_families_text_names_the_catalogue_methods(tmp_path, capsys):
    """The methods --families is for come from the catalogue (every method that is not a prototype method), in
    the simulate help and in the refusal for a prototype method."""
    from hfl_components.flare import catalogue

    takes = [m for m in catalogue.methods() if not catalogue.is_prototype(m)]
    assert "fens" in takes and "fedsaf" not in takes  # FENS's sites train any family
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"{', '.join(takes)}: one model family per site" in help_text
    proto = catalogue.prototype_methods()[0]
    out = tmp_path / "run"
    assert main(["simulate", "--method", proto, "--families", "cnn,cnn", "--sites", "2", "--out", str(out)]) == 2
    _one_line(capsys, f"--families is for {', '.join(takes)})")
    assert not out.exists()


FAMS = "cnn,cnn,densenet,densenet,resnet,resnet"


@pytest.mark.parametrize("methods, says", [("local,fedsaf", "(local, fedsaf: prototype methods (and local beside "
                                                             "them) train the heterogeneous backbone pool)"),
                                           ("fedsaf,fedtopo", "(fedsaf, fedtopo: prototype methods train")])
def test_compare_refuses_families_when_no_method_takes_it(tmp_path, capsys, methods, says):
    """Every method of the comparison trains the prototype backbone pool (Local beside prototype methods does too):
    --families would be dropped without a word; one line naming the methods and the option, nothing written."""
    out = tmp_path / "cmp"
    rc = main(["compare", "--methods", methods, "--families", FAMS, "--data", str(tmp_path), "--out", str(out),
               "--dry-run"])
    assert rc == 2
    _one_line(capsys, "cxr-hfl compare: --families: no method in --methods takes it", says, "drop --families")
    assert not out.exists()


def test_compare_names_the_methods_that_ignore_families_and_their_profiles_agree(tmp_path, capsys):
    """local,fedavg,fedsaf: one line at the start says local and fedavg take --families and fedsaf ignores it; the
    site configs compare writes agree (local's and fedavg's sites get the families in site order, fedsaf's the
    prototype pool). local,fedavg: no such line."""
    import yaml

    from nvflare_jobs.cli import build_parser
    from nvflare_jobs.compare import CompareOptions
    from nvflare_jobs.compare.run import _checked, write_method_profile

    def checked(methods):
        args = CompareOptions.from_mapping(vars(build_parser().parse_args(
            ["compare", "--methods", methods, "--families", FAMS, "--data", str(tmp_path / "data"), "--out",
             str(tmp_path / "cmp")])))
        return args, _checked(args)[0]

    (tmp_path / "data").mkdir()
    args, methods = checked("local,fedavg,fedsaf")
    said = [ln for ln in capsys.readouterr().out.splitlines() if "--families" in ln]
    assert said == ["[compare] --families: used by local, fedavg; ignored by fedsaf (prototype methods train the "
                    "heterogeneous backbone pool)"]
    part = tmp_path / "part"
    (part / "sites").mkdir(parents=True)
    for i in range(1, 7):
        (part / "sites" / f"site-{i}.csv").write_text("path,label,split\n")
    for m in methods:
        prof = write_method_profile(part, tmp_path / m, m, 0, args)
        fams = [yaml.safe_load((prof / f"site-{i}.yaml").read_text())["model"]["family"] for i in range(1, 7)]
        assert (fams == FAMS.split(",")) == (m != "fedsaf"), (m, fams)
    checked("local,fedavg")
    assert "--families" not in capsys.readouterr().out


@pytest.mark.parametrize("cmd", (["evaluate", "--run", "R", "--data", "D"], ["compare", "--out", "C"]))
def test_negative_n_boot_is_refused_naming_the_option(capsys, cmd):
    with pytest.raises(SystemExit) as e:
        main([*cmd, "--n-boot", "-5"])
    assert e.value.code == 2
    assert "argument --n-boot: expected a whole number >= 0, got -5" in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize("sizes", ("128,64,96", "64,64,128"))
@pytest.mark.parametrize("cmd", ("simulate", "compare"))
def test_input_sizes_out_of_order_are_refused_before_writing(tmp_path, capsys, sizes, cmd):
    out = tmp_path / "out"
    assert main([cmd, "--method" if cmd == "simulate" else "--methods", "ohfl", "--input-sizes", sizes,
                 "--out", str(out)]) == 2
    _one_line(capsys, f"--input-sizes {sizes}: give them smallest to largest, each once (e.g. "
                      f"{','.join(map(str, sorted({int(x) for x in sizes.split(',')})))})")
    assert not out.exists()


def test_ohfl_without_probe_pool_or_data_free_is_refused_before_writing(tmp_path, capsys):
    """--probe none needs --data-free: refused before the run folder is made, so the corrected command needs no
    --overwrite."""
    out = tmp_path / "run"
    assert main(["simulate", "--method", "ohfl", "--probe", "none", "--out", str(out)]) == 2
    _one_line(capsys, "--probe none", "--data-free")
    assert not out.exists()


def test_simulate_missing_data_is_one_line_and_makes_no_folder(tmp_path, capsys):
    out = tmp_path / "run"
    missing = tmp_path / "nonexist"
    assert main(["simulate", "--method", "fedavg", "--data", str(missing), "--out", str(out)]) == 2
    assert _one_line(capsys, f"--data {missing}: no such file or folder")
    assert not out.exists()


@pytest.mark.parametrize("name", ["metrics.json", "external/x/audit.json", "external/x/summary.json",
                                  "job_options.json"])
@pytest.mark.parametrize("text", ["", "{\"method\": "])
def test_report_names_an_empty_or_truncated_json_file(tmp_path, capsys, name, text):
    """An empty or truncated JSON file of a run: one line naming that file, exit 2, no report."""
    run = tmp_path / "run"
    (run / "external" / "x").mkdir(parents=True)
    (run / "metrics.json").write_text('{"method": "fedavg", "labels": "binary", "sites": {}}')
    (run / "external" / "x" / "summary.json").write_text('{"models": {}, "n_images": 0}')
    (run / "external" / "x" / "audit.json").write_text("{}")
    (run / "job_options.json").write_text("{}")
    (run / name).write_text(text)
    assert main(["report", str(run)]) == 2
    assert _one_line(capsys, "cxr-hfl report: ").startswith(f"cxr-hfl report: {run / name}: unreadable as JSON (")
    assert not (run / "report.html").exists()


def _all_parsers(parser, path=()):
    """(command path, parser) for the parser and every subparser under it, depth first."""
    import argparse

    yield path, parser
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _all_parsers(sub, (*path, name))


def test_no_parser_of_the_cli_accepts_an_abbreviated_option(tmp_path, capsys):
    """argparse's prefix matching took `simulate --local-epoch 5` as --local-epochs: every parser (top level and
    each subcommand, nested ones too, and simulate's own options parser) refuses abbreviations with argparse's
    usage error, before anything is written; the full option still parses."""
    from nvflare_jobs.cli import build_parser
    from nvflare_jobs.commands.simulate import options_from_argv

    parsers = list(_all_parsers(build_parser()))
    assert {("simulate",), ("site", "check"), ("poc",)} <= {p for p, _ in parsers}
    assert [p for p, parser in parsers if parser.allow_abbrev] == []
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--method", "ohfl", "--local-epoch", "5", "--out", str(out)])
    assert e.value.code == 2 and "unrecognized arguments: --local-epoch 5" in capsys.readouterr().err
    assert not out.exists()
    args = build_parser().parse_args(["simulate", "--method", "ohfl", "--local-epochs", "5", "--out", str(out)])
    assert args.local_epochs == 5
    for cmd in (["site", "check", "--config", "x.yaml", "--no-image"], ["evaluate", "--run", "r", "--data", "d",
                                                                        "--no-aud"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(cmd)
        assert e.value.code == 2 and f"unrecognized arguments: {cmd[-1]}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        options_from_argv(["--method", "ohfl", "--local-epoch", "5"])
    assert e.value.code == 2 and "unrecognized arguments: --local-epoch 5" in capsys.readouterr().err


def _methods():
    from hfl_components.flare import catalogue

    return catalogue.methods()


@pytest.mark.parametrize("method", _methods())
def test_zero_local_epochs_is_refused_naming_the_option_before_writing(tmp_path, capsys, method):
    """Every method trains its sites only in their local epochs (OHFL and FENS: before their one upload), so
    --local-epochs 0 is refused in one line naming it, before the run folder is made (a missing --data would be
    the next refusal, so nothing could start here either way); 1 passes the same check."""
    from nvflare_jobs.spec import resolve

    out = tmp_path / "run"
    assert main(["simulate", "--method", method, "--local-epochs", "0", "--data", str(tmp_path / "none"),
                 "--out", str(out)]) == 2
    _one_line(capsys, "--local-epochs 0", f"{method}'s sites must train at least 1 local epoch")
    assert not out.exists()
    assert resolve(method, {"local_epochs": 1}).local_epochs == 1


def test_zero_local_epochs_is_refused_by_export_job_and_compare_too(tmp_path, capsys):
    from tests.deploy_helpers import REPO_ROOT

    job = tmp_path / "job"
    assert main(["export-job", "--method", "fens", "--profile", str(REPO_ROOT / "site_configs" / "consortium"),
                 "--local-epochs", "0", "--out", str(job)]) == 2
    _one_line(capsys, "--local-epochs 0", "before their one upload")
    assert not job.exists()
    cmp = tmp_path / "cmp"
    assert main(["compare", "--methods", "local,fedavg,ohfl", "--local-epochs", "0", "--dry-run", "--out",
                 str(cmp)]) == 2
    _one_line(capsys, "--local-epochs 0")
    assert not cmp.exists()


def test_compare_site_configs_record_a_variants_own_epochs(tmp_path):
    """The site configs compare writes for ``ohfl:local_epochs=30:finetune_epochs=0`` say 30 and 0 (they said the
    planned 20 + 10, then 10 fine-tuning epochs for any 0), and the default OHFL run's say 20 and 10."""
    import yaml

    from nvflare_jobs.cli import build_parser
    from nvflare_jobs.compare import CompareOptions
    from nvflare_jobs.compare.run import _checked, write_method_profile

    (tmp_path / "data").mkdir()
    args = CompareOptions.from_mapping(vars(build_parser().parse_args(
        ["compare", "--methods", "ohfl,ohfl:local_epochs=30:finetune_epochs=0", "--data", str(tmp_path / "data"),
         "--out", str(tmp_path / "cmp")])))
    methods = _checked(args)[0]
    part = tmp_path / "part"
    (part / "sites").mkdir(parents=True)
    for i in range(1, 7):
        (part / "sites" / f"site-{i}.csv").write_text("path,label,split\n")
    got = {}
    for k, m in enumerate(methods):
        prof = write_method_profile(part, tmp_path / f"m{k}", m, 0, args)
        cfg = yaml.safe_load((prof / "site-1.yaml").read_text())
        got[m] = (cfg["local_epochs"], cfg["finetune_epochs"])
    assert got == {"ohfl": (20, 10), "ohfl:local_epochs=30:finetune_epochs=0": (30, 0)}
