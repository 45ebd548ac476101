"""Moved to :mod:`hfl_components.flare.privacy` (the site layer owns what the site script needs, so that
nothing under ``hfl_components`` imports ``nvflare_jobs``). This name stays for compatibility: it *is* that module
(same object, so monkeypatching either name patches both)."""
import sys

from hfl_components.flare import privacy as _impl

sys.modules[__name__] = _impl
