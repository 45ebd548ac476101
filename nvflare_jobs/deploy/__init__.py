"""Real deployment: NVFlare provisioning, POC mode, job export/submission and result download.

Everything here drives NVFlare's own command line (``nvflare provision``, ``nvflare poc``, ``nvflare job``) as
subprocesses, with an environment that keeps NVFlare's state out of the user's home:

* ``NVFLARE_POC_WORKSPACE`` = ``<poc dir>/nvflare_poc`` (the POC participants' workspaces),
* ``HOME`` = ``<poc dir>/home`` (NVFlare keeps its startup-kit registry in ``~/.nvflare/config.conf``),
* ``PATH`` starts with this interpreter's ``bin`` folder (the POC start scripts run ``python3``, which must be the
  interpreter that has ``cxr-hfl`` and NVFlare installed),
* ``CXR_HFL_SITE_CONFIG_DIR`` removed, so POC sites find their config the production way:
  ``<site workspace>/local/cxr_hfl/<site>.yaml`` (see :mod:`hfl_components.flare.site_config`).

The POC consortium is provisioned from the same ``site_configs/project.yml`` as production (its coordinator admin
and role), with the hospitals renamed to the profile's site names, the server on localhost, and the one
``project_admin`` that ``nvflare poc`` requires. Jobs are submitted with the coordinator's startup kit, so a POC run
shows that the provisioned coordinator role may submit (and download) this platform's jobs.

State of a POC folder is kept in ``<poc dir>/cxr_hfl_poc.json``.

The public face of the private parts ``_env`` (the nvflare command line), ``_connect`` (are the expected sites
connected before a submit), ``_provision`` (startup kits),
``_export`` (portable job folders), ``_poc`` (a local consortium) and ``_results`` (downloaded runs).
"""
from nvflare_jobs.deploy._env import (DEFAULT_PROJECT, POC_ADMIN, REPO, SERVER_PORTS, SITE_SCRIPT_NAME, STATE_FILE,
                                      DeployError, nvflare_env, nvflare_exe, run_nvflare)
from nvflare_jobs.deploy._connect import OVERRIDE_FLAG, check_connected
from nvflare_jobs.deploy._export import (check_job_folder, check_server_app, export_portable, make_portable,
                                          not_a_job)
from nvflare_jobs.deploy._poc import Poc, port_in_use
from nvflare_jobs.deploy._kits import (SERVER_ALLOW, allow_controllers, configure_server_kit, no_log_streaming,
                                       protect_keys, server_store)
from nvflare_jobs.deploy._provision import KIT_CERT, coordinator, load_project, provision, submitters
from nvflare_jobs.deploy._results import assemble_downloaded, run_findings

__all__ = ["OVERRIDE_FLAG", "check_connected", "DEFAULT_PROJECT", "POC_ADMIN", "REPO", "SERVER_PORTS", "SITE_SCRIPT_NAME", "STATE_FILE", "DeployError",
           "nvflare_env", "nvflare_exe", "run_nvflare", "check_job_folder", "check_server_app", "export_portable", "make_portable", "not_a_job",
           "Poc", "port_in_use", "KIT_CERT", "SERVER_ALLOW", "allow_controllers", "coordinator", "load_project",
           "provision", "submitters", "configure_server_kit", "no_log_streaming", "protect_keys", "server_store", "assemble_downloaded", "run_findings"]
