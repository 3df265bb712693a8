"""One process of a multi-controller learner run on a fixed batch (run by
tests/test_distributed.py, never collected by pytest itself).

  python -m tests.distributed.learner_worker OUT_DIR [--coordinator H:P --num-processes N
      --process-id I]

Builds the tiny model on a `data` mesh over every device of every process, feeds this
process's rows of a fixed 8-row batch, runs 3 SGD steps, saves and restores the run
state with Orbax (every process taking part), copies the parameters device to device
onto this process's own devices in an engine's layout (`distributed.copy_to_local`,
checked against the host copy), and process 0 writes the final parameters (and the
restored ones) to OUT_DIR/params.npz.
"""

import argparse
import json
import os


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("out")
  p.add_argument("--coordinator")
  p.add_argument("--num-processes", type=int)
  p.add_argument("--process-id", type=int)
  args = p.parse_args()

  from jaxagent import distributed

  distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  import jax
  import numpy as np

  from jaxagent.batch import pack
  from jaxagent.checkpoint import RunCheckpointer
  from jaxagent.config import LearnerConfig
  from jaxagent.data import synthetic_segment
  from jaxagent.learner import Learner
  from jaxagent.models.config import preset
  from jaxagent.models.params import param_shardings
  from jaxagent.models.sharding import SAMPLE_RULES, make_mesh

  segs = [synthetic_segment(i, seed=0, vocab=256, target=97, min_len=12, max_len=30)
          for i in range(24)]
  batch, _ = pack(segs, 8, 64)
  rows = distributed.process_rows(batch.tokens.shape[0])
  local = type(batch)(*(None if x is None else x[rows] for x in batch))
  learner = Learner(preset("tiny"), LearnerConfig(optimizer="sgd", lr=0.5), make_mesh())
  state = learner.init_state(0)
  for _ in range(3):
    state, metrics = learner.step(state, local)
  loss = float(metrics["loss"])
  ckpt = RunCheckpointer(os.path.join(args.out, "checkpoints"), keep=1, async_save=False)
  ckpt.save(3, state, {"note": "distributed test"}, None, force=True)
  ckpt.close()
  ckpt = RunCheckpointer(os.path.join(args.out, "checkpoints"), keep=1, async_save=False)
  restored, meta = ckpt.restore(learner.abstract_state(), None)
  ckpt.close()
  params = distributed.host_copy(state.params)
  again = distributed.host_copy(restored.params)
  # The engine's copy: this process's devices (tensor-split in two), device to device.
  local_mesh = make_mesh(tensor=2, devices=jax.local_devices())
  targets = param_shardings(preset("tiny"), local_mesh, SAMPLE_RULES)
  engine_copy = distributed.copy_to_local(state.params, targets)
  for (path, x), t, want in zip(jax.tree_util.tree_leaves_with_path(engine_copy),
                                jax.tree.leaves(targets), jax.tree.leaves(params)):
    assert x.is_fully_addressable and x.sharding == t, path
    np.testing.assert_array_equal(np.asarray(x), want, err_msg=str(path))
  if jax.process_count() > 1:  # engines on half the devices: not a device path (host copy)
    half = make_mesh(devices=jax.local_devices()[:2])
    try:
      distributed.copy_to_local(state.params, param_shardings(preset("tiny"), half,
                                                              SAMPLE_RULES))
      raise AssertionError("copy_to_local accepted meshes that miss devices")
    except ValueError as e:
      assert "do not cover" in str(e), e
  state, _ = learner.step(state, local)  # donates state.params: the copy must survive it
  for x, want in zip(jax.tree.leaves(engine_copy), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(x), want)
  local_devices = sorted({d.id for x in jax.tree.leaves(engine_copy)
                          for d in x.sharding.device_set})
  i = jax.process_index()
  gathered = distributed.gather_json({"process": i, "tasks": ["t"] * i})
  if distributed.is_primary():
    np.savez(os.path.join(args.out, "params.npz"), loss=loss, gathered=json.dumps(gathered),
             processes=jax.process_count(), devices=jax.device_count(),
             local_devices=np.asarray(local_devices),
             **{f"p/{k}": v for k, v in params.items()},
             **{f"r/{k}": v for k, v in again.items()})


if __name__ == "__main__":
  main()
