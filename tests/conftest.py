import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

# One persistent XLA compilation cache for the session, inherited by every process a
# test starts (trainers, servers, launchers): they compile the same small models, and
# after the first one they load the executables instead (a tiny training run starts in
# ~8 s instead of ~19 s). JAX reads these when it is imported, just below.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # (xdist's workers inherit the session's)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxagent-tests-xla-cache-")
  # Removed when the session's process exits (each run left one behind in /tmp).
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

# Implicit rank promotion hides shape bugs; the whole suite runs with it off.
jax.config.update("jax_numpy_rank_promotion", "raise")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The default tier compiles many small programs, each once or twice: at XLA's default
# optimisation, the CPU code generator (LLVM at -O2) took most of its time (828 s for the
# tier here; 646 s at -O0, tests/test_attention.py 49 s -> 26 s). It compiles at -O0:
# the programs run slower, which a tiny model's few steps do not feel. The end-to-end
# tier (`-m slow`: whole training runs, which run more than they compile) keeps the
# default, and so does a session given its own level in XLA_FLAGS. What these tests
# check is the code, not the CPU's code generator; an accelerator's numerics are
# tools/gpu_check.sh's.
FAST_COMPILE = "--xla_backend_optimization_level=0"


def pytest_configure(config):
  # (before any test module is collected: XLA reads XLA_FLAGS when its backend starts)
  if (config.option.markexpr or "").strip() == "not slow" and (
      "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()


def run_multidevice(code: str, devices: int = 8, timeout: int = 600) -> str:
  """Runs `code` in a fresh Python with `devices` forced CPU devices; returns its stdout."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} "
                      f"--xla_force_host_platform_device_count={devices}").strip()
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout)
  if proc.returncode != 0:
    raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
  return proc.stdout


@pytest.fixture
def multidevice():
  return run_multidevice


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory):
  """A folder the test session's xdist workers share (None outside xdist), for what one
  worker makes and the others load (`tests.rollout_server.conftest.memorise`)."""
  if not os.environ.get("PYTEST_XDIST_WORKER"):
    return None
  return tmp_path_factory.getbasetemp().parent


@pytest.fixture(scope="session")
def random_params():
  """The tiny test model's random weights (tests/rollout_server/conftest.py's CFG)."""
  from jaxagent.models.params import init_params
  from tests.rollout_server.conftest import CFG
  return jax.device_get(init_params(CFG, 0))
