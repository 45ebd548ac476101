"""A compare variant whose option belongs to another method (``fedavg:strategy=cdd``: an OHFL option) is refused in
one line naming the variant and the option, before anything is written; ``simulate`` would drop the option with a
warning, and the comparison would report a row labelled with an option that never ran."""


def test_a_variant_option_of_another_method_is_refused(tmp_path, capsys):
    from nvflare_jobs.cli import main  # imported here: compare's method list is read at its first import

    out = tmp_path / "cmp"
    for variant in ("fedavg:strategy=cdd", "central:strategy=cdd"):
        assert main(["compare", "--methods", f"local,{variant}", "--dry-run", "--out", str(out)]) == 2, variant
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"cxr-hfl compare: variant {variant}: ") and "strategy" in err, err
        assert "not an option of" in err and len(err.splitlines()) == 1 and not out.exists(), err


def test_a_variant_of_a_run_option_or_its_own_option_passes():
    from nvflare_jobs.compare import check_variant

    for ok in ("central:augment=border", "fedavg:local_epochs=3", "ohfl:strategy=cdd", "central:central_input_size=64"):
        assert check_variant(ok) is None, ok


def test_a_seed_named_twice_is_refused_before_anything_is_written(tmp_path, capsys):
    """``--seeds 0,0`` ran (or resumed) the same run folders twice and recorded seed 0 twice in compare.json; it is
    refused in one line naming the option and the seed, as a method named twice is."""
    from nvflare_jobs.cli import main

    out = tmp_path / "cmp"
    for dry in (["--dry-run"], []):
        assert main(["compare", "--methods", "local", "--seeds", "0,1,0", "--sites", "3", *dry, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err == "cxr-hfl compare: --seeds names 0 more than once (one run folder per seed and method)", err
        assert not out.exists()


def test_negative_epoch_options_are_refused_even_when_no_method_runs_them_alone(tmp_path, capsys):
    """``--methods central --finetune-epochs -1`` ran every method at E = 20 - 1 = 19 epochs (only the resulting
    budget was checked): a negative L or F is refused by argparse, exit 2, naming the option."""
    import pytest

    from nvflare_jobs.cli import main

    out = tmp_path / "cmp"
    for flag in ("--finetune-epochs", "--local-epochs"):
        with pytest.raises(SystemExit) as e:
            main(["compare", "--methods", "central", flag, "-1", "--dry-run", "--out", str(out)])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"argument {flag}: expected a whole number >= 0, got -1" in err, err
        assert not out.exists()
