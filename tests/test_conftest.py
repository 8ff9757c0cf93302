"""The test set-up itself: conftest.py leaves the process environment alone (a user's own runs, and child processes,
inherit nothing from it) and still puts the JAX reference on the CPU."""

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_conftest_sets_no_environment_and_jax_runs_on_cpu():
    code = (
        "import os, sys; sys.path.insert(0, sys.argv[1]); before = dict(os.environ)\n"
        "import conftest; conftest.pytest_configure(None)\n"
        "import jax; assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())\n"
        "print(jax.default_backend())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    r = subprocess.run([sys.executable, "-c", code, str(TESTS)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "cpu"
