"""The option machinery under the method catalogue, knowing no method: :class:`Option` (one method option), its
typed check :func:`check_option`, :func:`validate` (every option of one catalogue entry), the reusable range checks
and :func:`resolve` (an object named ``"module:name"``). The catalogue builds its entries from these; the
controllers, which the catalogue names, use them without importing the catalogue."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

UNSET = object()


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
    cli_default: Any = UNSET
    required: str | None = None
    fixed: Any = UNSET
    what: str | None = None
    strict: bool = False

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.key.replace("_", "-")

    @property
    def has_fixed(self) -> bool:
        """True when the method always uses :attr:`fixed` whatever is given."""
        return self.fixed is not UNSET

    @property
    def argparse_default(self):
        return self.default if self.cli_default is UNSET else self.cli_default


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


def in_unit_interval(v) -> str | None:
    return None if 0.0 <= float(v) < 1.0 else f"rho must lie in [0, 1), got {v}"


def non_negative(name: str) -> Callable[[Any], str | None]:
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


def validate(entry, opts: dict, *, require: bool = True) -> dict:
    """Check ``opts`` against the options of one catalogue entry (``entry.name``, ``entry.options``).

    Returns:
        ``{key: value}`` of the entry's own options: the given value typed and checked, the default when missing or
        None, the ``fixed`` value where the method fixes one (``require=False``: a missing required option is not
        an error yet). Keys of other methods are ignored.

    Raises:
        OptionError: naming the method, the option and the allowed values, for a bad value or a missing required
            one.
    """
    out = {}
    for o in entry.options:
        v = opts.get(o.key)
        if v is None:
            if o.required and o.fixed is UNSET and require:
                raise OptionError(o.required)
            val = list(o.default) if isinstance(o.default, list) else o.default
        else:
            val = check_option(entry.name, o, v)
        out[o.key] = o.fixed if o.fixed is not UNSET else val
    return out
