"""Ray for the controller: `init_ray(config)` connects to the cluster `ray.address` names or starts a local one, and
starts the watchdog (rltrain/watchdog.py) so that the processes this driver started die with it, however it dies."""

from __future__ import annotations

import subprocess

import ray

from rltrain.watchdog import start_watchdog
from rltrain.workers.group import RayConfig


def init_ray(config: RayConfig) -> subprocess.Popen | None:
    """ray.init with the ray section's settings and, on Linux, the watchdog; returns its process (None where none
    runs)."""
    # ray.address null: a Ray of this run's own ("local"), never one another run on this machine started (Ray's
    # default would join it, and that run's end would take this one's workers with it)
    ray.init(address=config.address or "local", num_cpus=config.num_cpus, include_dashboard=False,
             log_to_driver=True, configure_logging=False)
    return start_watchdog()
