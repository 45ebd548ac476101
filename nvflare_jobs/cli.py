"""``cxr-hfl``: one entry point, one module per subcommand.

Each command module defines ``register(subparsers)`` which adds its parser and sets ``func``. Heavy imports
(torch, nvflare) belong inside the command's run function so ``cxr-hfl --help`` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand modules, in help order; each has register(subparsers)
COMMAND_MODULES = [
    "nvflare_jobs.commands.partition",  # partition, inspect
    "nvflare_jobs.commands.simulate",  # simulate, export-job
    "nvflare_jobs.commands.deploy",  # provision, poc
    "nvflare_jobs.commands.status",  # status, results, submit, abort
    "nvflare_jobs.commands.crosssite",  # export-eval
    "nvflare_jobs.commands.site",  # site check
    "nvflare_jobs.commands.evaluate",  # compare, evaluate, predict, report
    "nvflare_jobs.commands.data",  # data fetch
]


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that refuses abbreviated long options (``--local-epoch`` is not ``--local-epochs``) with
    argparse's usage error. Every subparser inherits it: ``add_subparsers`` makes its parsers of the parent's class."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="cxr-hfl", description="Heterogeneous federated learning for chest X-rays")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # command module not present in this build
                continue
            raise
        mod.register(sub)
    return p


# errors that say all a user needs (bad input, a missing or unwritable path): no traceback hint
_PLAIN_ERRORS = (ValueError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
                 PermissionError)


def _debug_hint(e: BaseException) -> str:
    """The tail of the one error line: a pointer to the traceback only for errors other than plain bad input
    (e.g. an I/O error of the disk), where the traceback may be needed to find the cause."""
    return "" if isinstance(e, _PLAIN_ERRORS) else " (CXR_HFL_DEBUG=1 shows the traceback)"


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args._argv = list(sys.argv[1:] if argv is None else argv)  # the command as typed, for the records
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from nvflare_jobs.proctree import exit_code, handle_interrupts, kill_tree

    try:
        with handle_interrupts():
            rc = args.func(args)
    except KeyboardInterrupt:
        kill_tree()  # anything started after the signal handler's sweep
        out = getattr(args, "out", None)
        if args.command in ("simulate", "compare") and out:
            from nvflare_jobs.status import mark_interrupted

            mark_interrupted(out)  # `cxr-hfl status` says "interrupted" at once
        hint = ""
        started = os.path.isdir(os.path.join(out or "", "workspace"))  # a run refused before it started left none
        if args.command == "simulate" and out and started and not os.path.exists(os.path.join(out, "metrics.json")):
            hint = f"; rerun with --overwrite to replace the unfinished run in {out}"
        elif args.command == "compare" and out:
            hint = f"; rerun the same command to resume (finished runs in {out} are kept)"
        if args.command == "poc":  # the POC's server and sites are daemons, not this command's children
            print(f"cxr-hfl poc {getattr(args, 'poc_command', '')}: interrupted; the POC's server and sites are not "
                  "this command's children and may still run (`cxr-hfl poc status` / `cxr-hfl poc stop` with the "
                  "same --workspace)", file=sys.stderr)
            return exit_code()
        print(f"cxr-hfl {args.command}: interrupted, all its processes stopped{hint}", file=sys.stderr)
        return exit_code()
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        print(e.code, file=sys.stderr)  # sys.exit("cxr-hfl: ...") of a command: bad input, exit code 2 (README)
        return 2
    except (ValueError, OSError) as e:  # user-facing problems (bad input, missing files): one clear line
        if os.environ.get("CXR_HFL_DEBUG"):
            raise
        print(f"cxr-hfl {args.command}: error: {e}{_debug_hint(e)}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
