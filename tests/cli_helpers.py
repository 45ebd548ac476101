"""Shared assertions of the CLI refusal tests."""
from __future__ import annotations


def one_line(capsys, *says) -> str:
    """The captured stderr: one line, no traceback, holding every string of ``says``; returns it."""
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for s in says:
        assert s in err, err
    return err
