"""How a non-square image is made S x S: the choices of ``build_transforms(aspect=...)`` and of the site-config
key ``aspect`` (see :mod:`chest_xray.transforms`). Kept apart from the transforms so that reading the choices needs
neither torch nor MONAI."""
from __future__ import annotations

#: ``stretch`` (resize, aspect ratio not kept), ``letterbox`` (longer side to S, zero padding), ``crop`` (central
#: square); the first is the default for sites, the server's probe, ``evaluate`` and the benchmarks.
ASPECTS = ("stretch", "letterbox", "crop")
DEFAULT_ASPECT = ASPECTS[0]
