import os

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent.checkpoint import (RunCheckpointer, abstract_params_like, export_policy,
                                 latest_version, list_versions, load_policy)
from jaxagent.config import LearnerConfig
from jaxagent.data import take
from jaxagent.learner import Learner
from jaxagent.models.sharding import make_mesh
from tests.test_learner import CFG, make_batch


def equal(a, b):
  return all(jax.tree.leaves(jax.tree.map(
      lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), a, b)))


def data_iter():
  return iter(grain.MapDataset.range(1000).shuffle(seed=7).map(
      lambda i: {"seed": int(i)}).to_iter_dataset())


def batch_from(items):
  return make_batch(seed=sum(x["seed"] for x in items))


def test_restore_then_step_is_bitwise_identical(tmp_path):
  learner = Learner(CFG, LearnerConfig(correction_mode="truncate"), make_mesh())
  ckpt = RunCheckpointer(str(tmp_path / "ckpt"), keep=2, async_save=True)
  meta = {"tokenizer": {"vocab_sha256": "abc"}, "buffer_cursor": 17}

  # Never stopping: three steps.
  it = data_iter()
  state = learner.init_state(0)
  state, _ = learner.step(state, batch_from(take(it, 2)))
  ckpt.save(1, state, meta, it)
  ckpt.wait()
  for _ in range(2):
    state, _ = learner.step(state, batch_from(take(it, 2)))
  live = jax.device_get(state)

  # Stopping after step 1: restore state and data position, take the same two steps.
  it2 = data_iter()
  restored, got_meta = ckpt.restore(learner.abstract_state(), it2)
  assert got_meta == meta
  assert int(restored.step) == 1
  for _ in range(2):
    restored, _ = learner.step(restored, batch_from(take(it2, 2)))
  assert equal(jax.device_get(restored), live)
  ckpt.close()


def test_keeps_last_n_and_latest(tmp_path):
  learner = Learner(CFG, LearnerConfig(), make_mesh())
  state = learner.init_state(0)
  ckpt = RunCheckpointer(str(tmp_path / "ckpt"), keep=2, async_save=True)
  for step in range(1, 5):
    ckpt.save(step, state, {"step": step})
  ckpt.wait()
  assert ckpt.all_steps() == [3, 4] and ckpt.latest_step() == 4
  _, meta = ckpt.restore(learner.abstract_state())
  assert meta == {"step": 4}
  ckpt.close()
  with pytest.raises(FileNotFoundError):
    RunCheckpointer(str(tmp_path / "empty")).restore(learner.abstract_state())


def test_policy_export_is_immutable_and_registered(tmp_path):
  learner = Learner(CFG, LearnerConfig(), make_mesh())
  state = learner.init_state(0)
  root = str(tmp_path / "policy")
  p1 = export_policy(root, 1, state.params)
  state, _ = learner.step(state, make_batch())
  export_policy(root, 2, state.params, dtype=None, extra={"step": 1})
  with pytest.raises(FileExistsError):
    export_policy(root, 2, state.params)
  versions = list_versions(root)
  assert [v["version"] for v in versions] == [1, 2] and latest_version(root) == 2
  assert versions[0]["dtype"] == "bfloat16" and versions[1]["step"] == 1
  target = abstract_params_like(state.params, learner.param_shardings)
  v1 = load_policy(p1, abstract_params_like(state.params, learner.param_shardings, jnp.bfloat16))
  assert v1["wq"].dtype == jnp.bfloat16
  v2 = load_policy(versions[1]["path"], target)
  assert equal(v2, state.params)
  with pytest.raises(FileNotFoundError):
    load_policy(os.path.join(root, "v99"), target)


def test_policy_restores_onto_a_different_mesh(tmp_path, multidevice):
  out = multidevice(f"""
    import jax, numpy as np
    from jax.sharding import PartitionSpec as P
    from jaxagent.checkpoint import export_policy, load_policy, abstract_params_like
    from jaxagent.models.params import init_params, param_shardings
    from jaxagent.models.sharding import SAMPLE_RULES, make_mesh
    from tests.test_learner import CFG
    writer = make_mesh(2, 4, 1)  # FSDP-sharded training layout
    params = init_params(CFG, 3, writer)
    assert params["wq"].sharding.spec == P(None, "fsdp", "tensor", None)
    path = export_policy({str(tmp_path)!r}, 5, params, dtype=None)
    reader = make_mesh(4, 1, 2)  # the sampling layout: tensor parallel, no FSDP
    shardings = param_shardings(CFG, reader, SAMPLE_RULES)
    got = load_policy(path, abstract_params_like(params, shardings))
    assert got["wq"].sharding.spec == P(None, None, "tensor", None), got["wq"].sharding
    for k in params:
      np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(params[k]))
    print("OK")
  """)
  assert out.strip().endswith("OK")
