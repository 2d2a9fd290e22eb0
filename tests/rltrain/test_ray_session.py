"""init_ray with ray.address null starts a Ray of the run's own, also where another Ray is up on this machine (a
`ray start` head, or a simulated cluster as here): Ray's default would join that one, and its end would take this
run's workers with it."""

import os
import subprocess
import sys
from pathlib import Path

from ray.cluster_utils import Cluster

ROOT = Path(__file__).resolve().parents[2]
DRIVER = """
import ray
from rltrain.ray_session import init_ray
from rltrain.workers.group import RayConfig
init_ray(RayConfig(num_cpus=1))
print(ray.get_runtime_context().gcs_address)
"""


def test_a_local_run_starts_its_own_ray_beside_another_one():
    other = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "kernels"),
                                                           os.environ.get("PYTHONPATH", "")]))
        env.pop("RAY_ADDRESS", None)
        out = subprocess.run([sys.executable, "-c", DRIVER], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=180)
        assert out.returncode == 0, out.stderr[-2000:]
        address = out.stdout.strip().splitlines()[-1]
        assert address and address != other.address
    finally:
        other.shutdown()
