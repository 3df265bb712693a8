"""Multi-controller learner: 2 processes x 4 CPU devices give the parameters of
1 process x 8 devices on the same fixed batch, and checkpoint together."""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices: int) -> dict:
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(k, None)
  return env


def _worker(out, *extra, devices):
  return subprocess.Popen([sys.executable, "-m", "tests.distributed.learner_worker", str(out),
                           *extra], cwd=REPO, env=_env(devices), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def test_two_processes_train_like_one(tmp_path):
  one = _worker(tmp_path / "one", devices=8)
  out_one = one.communicate(timeout=300)[0]
  assert one.returncode == 0, out_one[-3000:]

  port = _free_port()
  procs = [_worker(tmp_path / "two", "--coordinator", f"127.0.0.1:{port}",
                   "--num-processes", "2", "--process-id", str(i), devices=4) for i in (0, 1)]
  outs = [p.communicate(timeout=300)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]

  a = np.load(tmp_path / "one" / "params.npz")
  b = np.load(tmp_path / "two" / "params.npz")
  assert int(a["processes"]) == 1 and int(b["processes"]) == 2
  assert int(a["devices"]) == int(b["devices"]) == 8
  np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5)
  names = [k for k in a.files if k.startswith("p/")]
  assert names
  for k in names:
    np.testing.assert_allclose(b[k], a[k], atol=1e-6, rtol=1e-5, err_msg=k)
    # Saved and restored by both processes together: the same values.
    np.testing.assert_array_equal(b["r/" + k[2:]], b[k])
  # Only process 0 wrote the shared file; both wrote their checkpoint shards.
  assert os.listdir(tmp_path / "two" / "checkpoints") == ["3"]


def test_partial_multi_process_settings_are_named():
  from jaxagent import distributed

  with pytest.raises(ValueError, match="missing: num_processes, process_id"):
    distributed.initialize("127.0.0.1:1234")
  with pytest.raises(ValueError, match="not in"):
    distributed.initialize("127.0.0.1:1234", 2, 2)
  assert distributed.initialize(None, None, None) is False
