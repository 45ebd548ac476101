"""Server-side workflows, one module per method; the classes keep their old paths
``hfl_components.flare.controllers.<Class>`` (exported jobs and the method catalogue name them so).

* :mod:`.base`: :class:`HFLController` (task broadcast, waits, option and upload checks, results on disk);
* :mod:`.baselines`: :class:`LocalController`, :class:`FedAvgController`;
* :mod:`.ohfl`: :class:`OHFLController`; :mod:`.fedsaf`: :class:`FedSAFController`; :mod:`.fedtopo`:
  :class:`FedTopoController`.
"""
from hfl_components.flare.controllers.base import (  # noqa: F401
    POLL_S,
    PROGRESS_EVENT,
    PROGRESS_KEY,
    RESULTS_DIR,
    HFLController,
    _jsonable,
    _payload_round,
)
from hfl_components.flare.controllers.baselines import FedAvgController, LocalController  # noqa: F401
from hfl_components.flare.controllers.fedsaf import FedSAFController  # noqa: F401
from hfl_components.flare.controllers.fedtopo import FedTopoController  # noqa: F401
from hfl_components.flare.controllers.ohfl import OHFLController  # noqa: F401
