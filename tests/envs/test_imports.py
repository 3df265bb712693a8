import subprocess
import sys

from tests.conftest import REPO


def test_envs_import_without_jax():
  code = """
import sys
for name in ("jax", "jaxlib", "flax", "optax"):
  sys.modules[name] = None  # any import of these now fails
import envs, envs.base, envs.tools, envs.sandbox, envs.verifier, envs.server, envs.filter
import envs.guess_number, envs.calculator, envs.python_tests
from envs.base import make
make("guess_number")
loaded = [m for m in sys.modules if sys.modules[m] is not None]
assert not [m for m in loaded if m.split(".")[0] in ("jax", "jaxlib", "flax", "optax")], loaded
print("ok")
"""
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                        timeout=60)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == "ok"
