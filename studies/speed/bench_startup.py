"""Start-up of the main job before NVFlare's simulator starts (federation overhead).

Runs ``cxr-hfl simulate --method ohfl --sites 6 --scheme width --seed 0`` (data: ``$CXR_DATA``) with
``FedJob.simulator_run`` patched to stop there, and prints the wall and process-CPU seconds (getrusage user+sys)
from interpreter start to that call, the seconds spent inside ``scan_dataset``, and which heavy modules are
imported by then. Nothing is simulated; the job is written to a temporary folder that is removed.

    CXR_DATA=../shared/data .venv/bin/python -m studies.speed.bench_startup
    CXR_SCAN_WORKERS=1 ... -m studies.speed.bench_startup      # the sequential scan, for comparison
"""
import resource
import sys
import tempfile
import time

T0 = time.perf_counter()

import nvflare.job_config.api as api  # noqa: E402

import chest_xray  # noqa: E402
import chest_xray.dataset as dataset  # noqa: E402


class _Stop(Exception):
    pass


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    """Run the CLI up to ``simulator_run`` and print the seconds (see the module docstring)."""
    scan = [0.0, 0.0]
    real_scan = dataset.scan_dataset

    def timed_scan(*a, **k):
        w, c = time.perf_counter(), _cpu()
        try:
            return real_scan(*a, **k)
        finally:
            scan[0] += time.perf_counter() - w
            scan[1] += _cpu() - c

    def stop(self, *a, **k):
        heavy = [m for m in ("torch", "sklearn", "ot", "scipy.stats", "monai") if m in sys.modules]
        print(f"reached simulator_run after {time.perf_counter() - T0:.2f} s wall, {_cpu():.2f} s CPU; "
              f"imported: {heavy}")
        raise _Stop()

    dataset.scan_dataset = chest_xray.scan_dataset = timed_scan
    api.FedJob.simulator_run = stop
    from nvflare_jobs.cli import main as cli

    with tempfile.TemporaryDirectory(prefix="bench_startup_") as out:
        sys.argv = ["cxr-hfl", "simulate", "--method", "ohfl", "--sites", "6", "--scheme", "width", "--seed", "0",
                    "--out", out, "--overwrite"]
        try:
            cli()
        except _Stop:
            pass
    print(f"scan_dataset: {scan[0]:.2f} s wall, {scan[1]:.2f} s CPU")


if __name__ == "__main__":
    import argparse

    # no options; --help explains the benchmark instead of running it
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                            epilog="environment: CXR_DATA (data root), CXR_SCAN_WORKERS (scan threads)").parse_args()
    main()
