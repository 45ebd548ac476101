"""Each method's NVFlare adapter, one module per method: its server controller (an NVFlare ``ModelController``) and
its site handlers (``handler(rt, params, meta)``, named by the method catalogue's ``site_handlers``).

* :mod:`.base`: :class:`HFLController` (task broadcast, waits, option and upload checks, results on disk);
* :mod:`.baselines`: :class:`LocalController`, :class:`FedAvgController` (``task_name`` and ``aggregator`` hooks);
* :mod:`.ohfl`: :class:`OHFLController` (its site handlers in :mod:`.ohfl_site`); :mod:`.fedsaf`:
  :class:`FedSAFController`; :mod:`.fedtopo`: :class:`FedTopoController`; :mod:`.fens`: :class:`FENSController`
  (FedAvg's round loop over an aggregator).

Exported jobs name the controller by its defining module (``hfl_components.flare.controllers.<module>.<Class>``).
"""
from hfl_components.flare.controllers.base import HFLController
from hfl_components.flare.controllers.baselines import FedAvgController, LocalController
from hfl_components.flare.controllers.fedsaf import FedSAFController
from hfl_components.flare.controllers.fedtopo import FedTopoController
from hfl_components.flare.controllers.fens import FENSController
from hfl_components.flare.controllers.ohfl import OHFLController

__all__ = ["HFLController", "LocalController", "FedAvgController", "OHFLController", "FedSAFController",
           "FedTopoController", "FENSController"]
