"""Bad input a hospital user types, found by a fresh reading of the README: each is refused with one line naming
the file or option (exit 2), no traceback, and nothing is left half-written that a corrected rerun would trip
over. In-process through the CLI's ``main`` (the same parsers and handlers as ``cxr-hfl``); no training."""
from __future__ import annotations

import pytest

from nvflare_jobs.cli import main


def _usage_error(capsys, argv, *says) -> str:
    """argparse's refusal: exit 2, its last stderr line names the option."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    for s in says:
        assert s in last, last
    return last


def _one_line(capsys, *says) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for s in says:
        assert s in err, err
    return err


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
