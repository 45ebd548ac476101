"""The parts of the method catalogue that know nothing of methods: :class:`Option` (one method option), its typed
check :func:`check_option` and the reusable range checks. Private to :mod:`hfl_components.flare.catalogue`, which
is the public face (``catalogue.Option``, ``catalogue.OptionError``)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

_UNSET = object()


@dataclass(frozen=True)
class Option:
    """One method option: ``opts[key]`` in a job, ``--flag`` on the command line.

    Args:
        key: the option's name in ``opts`` (and the argparse ``dest``).
        type: ``str``, ``int``, ``float``, ``bool`` or ``list`` (a repeatable flag; ``choices`` apply per item).
        default: the value used when the option is missing or None.
        choices: allowed values (None: any value of the type).
        help: one line for ``--help``.
        check: ``(value) -> error message or None`` for conditions beyond ``choices`` (ranges).
        flag: the command-line flag (default ``--key`` with ``_`` -> ``-``).
        cli_default: what argparse stores when the flag is absent (default: ``default``); None for options that
            are filled in later (so that ``--paper`` can tell "not given" from the default).
        required: a missing value is an error (the message is ``required``'s text).
        fixed: the method always uses this value whatever is given (``fedproto``'s alignment); the given value is
            still checked against ``choices``.
        what: the noun for one item in error messages (default: the key), e.g. ``ablation``.
        strict: the command line refuses the flag with a non-default value for a method that lacks the option
            (default: a warning that it is ignored).
    """

    key: str
    type: Any = str
    default: Any = None
    choices: tuple | None = None
    help: str = ""
    check: Callable[[Any], str | None] | None = None
    flag: str | None = None
    cli_default: Any = _UNSET
    required: str | None = None
    fixed: Any = _UNSET
    what: str | None = None
    strict: bool = False

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.key.replace("_", "-")

    @property
    def has_fixed(self) -> bool:
        """True when the method always uses :attr:`fixed` whatever is given."""
        return self.fixed is not _UNSET

    @property
    def argparse_default(self):
        return self.default if self.cli_default is _UNSET else self.cli_default


class OptionError(ValueError):
    """A method option with a value the method does not accept; the message names the method and the option."""


def check_option(method: str, o: Option, v) -> Any:
    """The checked, typed value of option ``o`` (``v`` not None)."""
    where = f"{method}: option {o.key!r} ({o.cli_flag})"
    if o.type is list:
        items = list(v) if isinstance(v, (list, tuple)) else [v]
        bad = [x for x in items if o.choices is not None and x not in o.choices]
        if bad:
            raise OptionError(f"{where}: unknown {o.what or o.key} {bad}; allowed: {list(o.choices)}")
        return sorted(set(items))
    try:
        if o.type is bool:
            if isinstance(v, str) and v.lower() in ("true", "false", "1", "0", "yes", "no"):
                v = v.lower() in ("true", "1", "yes")
            elif not isinstance(v, (bool, int)):
                raise TypeError
            val = bool(v)
        elif o.type is int:
            if isinstance(v, float) and not v.is_integer():
                raise TypeError
            val = int(v)
        elif o.type is float:
            val = float(v)
            if math.isnan(val):
                raise TypeError
        else:
            val = o.type(v)
    except (TypeError, ValueError):
        raise OptionError(f"{where}: expected {o.type.__name__}, got {v!r}") from None
    if o.choices is not None and val not in o.choices:
        raise OptionError(f"{where} must be one of {list(o.choices)}, got {val!r} ({o.help})")
    if o.check is not None:
        msg = o.check(val)
        if msg:
            raise OptionError(f"{where}: {msg}")
    return val


def repair_name(v) -> str:
    """``repair`` as a name: True/False read as ``layer``/``none`` (``fusion.pairwise.repair_mode``)."""
    return {True: "layer", False: "none"}.get(v, v) if isinstance(v, bool) else str(v)


def _in_unit_interval(v) -> str | None:
    return None if 0.0 <= float(v) < 1.0 else f"rho must lie in [0, 1), got {v}"


def _non_negative(name: str) -> Callable[[Any], str | None]:
    """A check: ``v`` is None or a finite number >= 0 (a loss weight or noise scale; inf is refused too)."""
    def check(v):
        return None if v is None or 0 <= float(v) < math.inf else f"{name} must be a finite number >= 0, got {v}"
    return check


def resolve(path: str):
    """The object at ``"package.module:name"`` or ``"package.module.Name"`` (imported on use)."""
    import importlib

    mod, sep, name = path.partition(":")
    if not sep:
        mod, _, name = path.rpartition(".")
    return getattr(importlib.import_module(mod), name)
