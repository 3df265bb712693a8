import os
import subprocess
import sys
import textwrap

import jax
import pytest

# Implicit rank promotion hides shape bugs; the whole suite runs with it off.
jax.config.update("jax_numpy_rank_promotion", "raise")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_multidevice(code: str, devices: int = 8, timeout: int = 600) -> str:
  """Runs `code` in a fresh Python with `devices` forced CPU devices; returns its stdout."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout)
  if proc.returncode != 0:
    raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
  return proc.stdout


@pytest.fixture
def multidevice():
  return run_multidevice
