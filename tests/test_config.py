import dataclasses
import os

import pytest

from jaxagent import config
from tests.conftest import REPO


def test_tiny_yaml_loads_with_types():
  cfg = config.load(config.RunConfig, os.path.join(REPO, "configs/tiny.yaml"))
  assert cfg.model.preset == "nano"
  assert isinstance(cfg.learner.lr, float)
  assert dataclasses.is_dataclass(cfg.learner)
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.learner.lr = 1.0


def test_a_config_from_a_pipe_is_read_once(tmp_path):
  """A reviewer: read twice (its top level checked, then loaded), a config from a pipe
  (--config /dev/stdin) loaded empty: the run went on with the defaults, saying nothing."""
  import threading

  pipe = str(tmp_path / "pipe")
  os.mkfifo(pipe)

  def write():
    with open(pipe, "w") as f:
      f.write("name: piped\nport: 9123\n")

  writer = threading.Thread(target=write)
  writer.start()
  cfg = config.load(config.ServerConfig, pipe)
  writer.join(10)
  assert (cfg.name, cfg.port) == ("piped", 9123)


def test_dotted_overrides():
  cfg = config.load(config.RunConfig, None, ["learner.lr=3e-4", "mesh.fsdp=2",
                                             "learner.dual_clip=3.0"])
  assert cfg.learner.lr == pytest.approx(3e-4)
  assert cfg.mesh.fsdp == 2
  assert cfg.learner.dual_clip == 3.0


def test_unknown_key_names_key_and_closest(tmp_path):
  with pytest.raises(config.ConfigError, match=r"learner\.lrr.*'lr'"):
    config.load(config.RunConfig, None, ["learner.lrr=1"])
  bad = tmp_path / "bad.yaml"
  bad.write_text("lerner:\n  lr: 1.0\n")
  with pytest.raises(config.ConfigError, match=r"bad\.yaml.*lerner.*'learner'"):
    config.load(config.RunConfig, str(bad))
  with pytest.raises(config.ConfigError, match=r"learner\.lrate.*did you mean 'lr'"):
    config.load(config.RunConfig, None, ["learner.lrate=1"])
  # One slip, one guess by either route, the key it begins with among them (the file
  # said 'lr_decay_steps', the command line 'lr': a new user).
  bad.write_text("learner:\n  lr_rate: 1.0\n")
  for source, overrides in ((str(bad), []), (None, ["learner.lr_rate=1"])):
    with pytest.raises(config.ConfigError) as raised:
      config.load(config.RunConfig, source, overrides)
    assert str(raised.value).endswith("did you mean 'lr' or 'lr_decay_steps'?"), raised.value
  with pytest.raises(config.ConfigError, match=r"did you mean 'lr_schedule' or 'lr'\?$"):
    config.load(config.RunConfig, None, ["learner.lr_schedulee=1"])
  # A section's key at the top level: the section's key by that name, before a loose
  # spelling of a top-level one (`lr` listed the top level's keys: a new user).
  bad.write_text("lr: 1.0\n")
  for source, overrides in ((str(bad), []), (None, ["lr=1"])):
    with pytest.raises(config.ConfigError, match=r"did you mean 'learner\.lr'\?$"):
      config.load(config.RunConfig, source, overrides)
  with pytest.raises(config.ConfigError, match=r"did you mean 'learner\.temperature' or "
                     r"'agent\.temperature'\?$"):
    config.load(config.RunConfig, None, ["temperature=1"])
  with pytest.raises(config.ConfigError, match=r"did you mean 'steps'\?$"):  # (here, closer)
    config.load(config.RunConfig, None, ["stepz=1"])
  # Nothing close: the section's keys are listed.
  with pytest.raises(config.ConfigError, match=r"the keys of learner are b1, b2, .*warmup_steps"):
    config.load(config.RunConfig, None, ["learner.xyzzy=1"])
  with pytest.raises(config.ConfigError, match=r"the keys of the top level are advantage, agent"):
    config.load(config.RunConfig, None, ["bogus=1"])
  with pytest.raises(config.ConfigError, match=r"not in 'ServedModelConfig'$"):  # no empty list
    config.load(config.RunConfig, None, ["serving.models.j.bogus=1"])


def test_wrong_type_names_key(tmp_path):
  with pytest.raises(config.ConfigError, match=r"learner\.microbatches"):
    config.load(config.RunConfig, None, ["learner.microbatches=many"])
  bad = tmp_path / "bad.yaml"
  bad.write_text("checkpoint:\n  async_save: sometimes\n")
  with pytest.raises(config.ConfigError, match=r"checkpoint\.async_save"):
    config.load(config.RunConfig, str(bad))


def test_a_value_for_a_section_or_a_list_names_the_key_and_the_form(tmp_path):
  """A merge error names no key: `learner: 3` said "config key '?'", and a list given as
  one value said "AnyNode is not a ListConfig" (a new user's round)."""
  bad = tmp_path / "bad.yaml"
  for text, key, value in (("learner: 3\n", "learner", "3"),
                           ("serving:\n  engine: 5\n", "serving.engine", "5")):
    bad.write_text(text)
    with pytest.raises(config.ConfigError, match=rf"config key '{key}' is a section .* not "
                                                 rf"{value}$"):
      config.load(config.RunConfig, str(bad))
  with pytest.raises(config.ConfigError, match=r"'learner' is a section .* not 3$"):
    config.load(config.RunConfig, None, ["learner=3"])
  # inside a field of named sections (serving.models: name -> a model's settings)
  with pytest.raises(config.ConfigError, match=r"'serving.models.j.engine' is a section"):
    config.load(config.RunConfig, None, ["serving.models.j.engine=3"])
  bad.write_text("env:\n  imports: /x/y.py\n")
  with pytest.raises(config.ConfigError, match=r"a list, not '/x/y.py' \(write imports: "
                                               r"\[a, b\] in YAML\)"):
    config.load(config.RunConfig, str(bad))
  with pytest.raises(config.ConfigError, match=r"'env.imports': a list, not '/x/y.py' "
                                               r"\(write env.imports=\[a,b\]\)"):
    config.load(config.RunConfig, None, ["env.imports=/x/y.py"])


@dataclasses.dataclass(frozen=True)
class _Needs:
  path: str = "???"  # OmegaConf's marker for a required value
  n: int = 1


def test_missing_required_value_names_key():
  with pytest.raises(config.ConfigError, match=r"missing required config value 'path'"):
    config.load(_Needs)
  assert config.load(_Needs, None, ["path=/x"]).path == "/x"


def test_every_bundled_config_loads_and_passes_the_start_checks():
  """Each run config under configs/ (a user's first command names one) loads and passes
  the checks a run makes before it builds anything."""
  from jaxagent.run_checks import check_config

  names = sorted(n for n in os.listdir(os.path.join(REPO, "configs")) if n.endswith(".yaml"))
  assert "smollm2_python_tests.yaml" in names
  for name in names:
    if name.startswith("server_"):  # (a rollout server's, `python -m rollout_server`)
      config.load(config.ServerConfig, os.path.join(REPO, "configs", name))
      continue
    check_config(config.load(config.RunConfig, os.path.join(REPO, "configs", name)))


def test_malformed_override():
  with pytest.raises(config.ConfigError, match="key=value"):
    config.load(config.RunConfig, None, ["steps"])
  # (a new user: a traceback through PyYAML; a suggestion of the key before the dots)
  with pytest.raises(config.ConfigError, match=r"^override 'agent.max_turns=\[1,2': its "
                                               r"value is not valid YAML \(did not find"):
    config.load(config.RunConfig, None, ["agent.max_turns=[1,2"])
  with pytest.raises(config.ConfigError, match=r"^override 'learner..lr=1': 'learner..lr' "
                                               r"is no key \(an empty part"):
    config.load(config.RunConfig, None, ["learner..lr=1"])


def test_a_cgroup_the_run_cannot_use_is_named_with_its_key():
  """env.cgroups (cgroups delegated to the run, for its sandboxes) is checked before the
  run starts its environments: a directory that is no cgroup is named."""
  from jaxagent.run_services import make_env_factory

  cfg = config.load(config.RunConfig, os.path.join(REPO, "configs/tiny.yaml"),
                    ["env.cgroups=[/proc]"])
  with pytest.raises(config.ConfigError, match=r"^env\.cgroups: cgroup /proc: neither the "
                                               r"memory nor the cpu controller"):
    make_env_factory(cfg)


def test_context_lengths_that_do_not_fit_are_named_together_with_the_overrides_that_fit():
  """A new user fitting a 1,400-token prompt met three errors one at a time, the first
  saying to lower agent.max_context_tokens below the prompt; and a preset's 1,024
  positions were trained past without a word (its export said 1,024). One error names
  every setting that does not fit and the overrides that fit them all, which pass."""
  from jaxagent.run_checks import check_config

  tiny = os.path.join(REPO, "configs/tiny.yaml")
  longer = ["agent.max_context_tokens=1400"]
  with pytest.raises(config.ConfigError) as e:
    check_config(config.load(config.RunConfig, tiny, longer))
  said = str(e.value)
  for part in ("agent.max_context_tokens (1400) is more than the engine takes",
               "data.seq_len (", "is shorter than agent.max_context_tokens (1400)",
               "or lower agent.max_context_tokens to"):
    assert part in said, said
  fit = said.split("fit with ", 1)[1].split(";", 1)[0].split()
  assert "positions" not in said  # (the tiny default's lengths are within the preset's)
  with pytest.raises(config.ConfigError, match="the model is for 1024 positions"):
    check_config(config.load(config.RunConfig, tiny, [f for f in fit
                                                       if not f.startswith("model.")]))
  check_config(config.load(config.RunConfig, tiny, fit))  # (the overrides said fit)


def test_every_task_comes_once_an_epoch_of_the_run_whatever_the_process_count(
    tmp_path, monkeypatch):
  """Each process shuffled its own slice of the file: with 7 tasks over 3 processes the
  slices' tasks came 20, 30 and 30 times, and fewer tasks than processes was refused
  (a reviewer). One order, each process taking every n-th task of it: every task comes
  equally often, and neighbouring data seeds no longer give one order an epoch apart
  (grain shuffles epoch e with seed + e). A run saved before keeps its order (1)."""
  import collections

  import jax

  from jaxagent.data import task_dataset

  def draws(path, processes, n, seed=0, order=2):
    out = []
    for p in range(processes):
      monkeypatch.setattr(jax, "process_index", lambda: p)
      monkeypatch.setattr(jax, "process_count", lambda: processes)
      it = iter(task_dataset(str(path), seed=seed, order=order))
      out.append([next(it)["id"] for _ in range(n)])
    return out

  path = tmp_path / "seven.jsonl"
  path.write_text("".join(f'{{"id": "t{i}", "env": "guess_number"}}\n' for i in range(7)))
  for processes, n in ((3, 7), (2, 14), (1, 21), (3, 70)):
    counts = collections.Counter(t for mine in draws(path, processes, n) for t in mine)
    assert set(counts.values()) == {processes * n // 7}, (processes, counts)
  (one,) = draws(path, 1, 14)
  (other,) = draws(path, 1, 14, seed=1)
  assert sorted(one[:7]) == sorted(one[7:]) and one[7:] != other[:7]
  for seed in (-1, 2 ** 40):  # (grain's own seed range: a traceback a step in)
    assert sorted(draws(path, 1, 7, seed=seed)[0]) == sorted(one[:7])
  two = tmp_path / "two.jsonl"
  two.write_text('{"id": "a", "env": "guess_number"}\n{"id": "b", "env": "guess_number"}\n')
  assert collections.Counter(sum(draws(two, 3, 4), [])) == {"a": 6, "b": 6}
  with pytest.raises(config.ConfigError, match="has 2 tasks for 3 processes"):
    draws(two, 3, 1, order=1)


@pytest.mark.parametrize("override,says", [
    (["rollout.update_mode=dran"], r"rollout\.update_mode"),  # (failed the first sync)
    (["eval.limit=-1"], r"eval\.limit must be >= 0"),  # (dropped the last task)
    (["agent.max_context_tokens=1"], r"agent\.max_context_tokens \(1\) must be more than "
                                     r"agent\.max_new_tokens"),  # (no turn ever played)
    (["agent.compaction=summary", "agent.summary_max_tokens=0"],
     r"agent\.summary_max_tokens must be in 1\.\.158"),  # (failed the first compaction)
    (["agent.compaction=summary", "agent.summary_max_tokens=159"],
     r"agent\.summary_max_tokens must be in"),  # (no room for the summariser's prompt)
])
def test_settings_that_failed_mid_run_or_did_nothing_are_named(override, says):
  """Each of these passed the checks and failed a rollout and a step later naming no
  key, played no turn, or was ignored (a reviewer)."""
  from jaxagent.run_checks import check_config

  tiny = os.path.join(REPO, "configs/tiny.yaml")
  with pytest.raises(config.ConfigError, match=says):
    check_config(config.load(config.RunConfig, tiny, override))
  if "agent.max_context_tokens=1" in override:  # (a black-box agent's context is its
    # harness's: the white-box checks refused its runs; a reviewer)
    check_config(config.load(config.RunConfig, tiny, [*override, "agent.kind=openai"]))


def test_rows_that_do_not_split_between_processes_are_named():
  """`data.rows` below the process count left each process 0 rows (the first step died
  on an assertion); a tensor axis across processes put two processes' different rows in
  one batch shard, and each trained on half the batch, none the same, without a word;
  shards unevenly over processes (a reviewer)."""
  import types

  import numpy as np

  from jaxagent.training_run import check_process_rows

  def mesh(data, fsdp, tensor, devices_each):
    devices = [types.SimpleNamespace(process_index=i // devices_each)
               for i in range(data * fsdp * tensor)]
    return types.SimpleNamespace(
        devices=np.asarray(devices, dtype=object).reshape(data, fsdp, tensor),
        axis_names=("data", "fsdp", "tensor"),
        shape={"data": data, "fsdp": fsdp, "tensor": tensor})

  tiny = os.path.join(REPO, "configs/tiny.yaml")
  cfg = config.load(config.RunConfig, tiny, ["data.rows=2"])
  check_process_rows(cfg, mesh(2, 1, 2, 2), 2)  # (each process's shard its own)
  check_process_rows(cfg, mesh(1, 2, 2, 2), 2)
  check_process_rows(cfg, mesh(1, 1, 4, 4), 1)
  with pytest.raises(config.ConfigError, match=r"data\.rows \(2\) must be a multiple of the "
                                               r"run's 4 processes"):
    check_process_rows(cfg, mesh(4, 1, 1, 1), 4)
  with pytest.raises(config.ConfigError, match=r"mesh\.tensor \(4\) spans devices of several "
                                               r"processes"):
    check_process_rows(cfg, mesh(1, 1, 4, 2), 2)
  with pytest.raises(config.ConfigError, match=r"fall \[2, 1\] on the run's 2 processes"):
    check_process_rows(cfg, mesh(3, 1, 1, 2), 2)


def test_served_models_that_read_the_policys_tokens_are_checked_at_the_start():
  """A teacher's engine shorter than the episodes failed every step (the whole segment is
  scored); a summariser not served failed at the first compaction; a scorer's vocabulary
  was compared by its embedding's rows alone (a 7B teacher padded to other rows than its
  1.5B student's was refused, another tokenizer of one size passed; a reviewer)."""
  import types

  from jaxagent.run_checks import check_config
  from jaxagent.run_services import other_vocabulary
  from jaxagent.tokenizer import Tokenizer, smollm2_tokenizer

  tiny = os.path.join(REPO, "configs/tiny.yaml")
  teacher = ["advantage.estimator=opd", "advantage.teacher=t",
             "serving.models.t.model.preset=nano", "serving.models.t.engine.max_seq_len=100",
             "serving.models.t.engine.max_prefill_length=64"]
  with pytest.raises(config.ConfigError, match=r"advantage\.teacher: serving\.models\.t\.engine"
                                               r"\.max_seq_len \(100\) is shorter than the "
                                               r"episodes it scores \(agent\.max_context"):
    check_config(config.load(config.RunConfig, tiny, teacher))
  check_config(config.load(config.RunConfig, tiny, teacher[:-2]))
  with pytest.raises(config.ConfigError, match=r"agent\.summarizer: no served model 's'"):
    check_config(config.load(config.RunConfig, tiny, ["agent.compaction=summary",
                                                      "agent.summarizer=s"]))
  policy = Tokenizer.byte_level()

  def served(tokenizer, rows):
    return types.SimpleNamespace(tokenizer=tokenizer, engine=types.SimpleNamespace(
        vocab_size=rows))

  assert other_vocabulary(served(Tokenizer.byte_level(), policy.vocab_size + 64), policy) is None
  assert "fewer than the policy's" in other_vocabulary(
      served(Tokenizer.byte_level(), policy.vocab_size - 1), policy)
  assert "is not the policy's" in other_vocabulary(
      served(smollm2_tokenizer(), 1 << 20), policy)


def test_a_mesh_of_fewer_devices_than_the_learners_is_said_and_refused_across_processes():
  """Explicit mesh sizes below the device count left the last devices out without a
  word: with several processes, every device of the last ones, which fed their rows to
  none (a reviewer)."""
  from tests.conftest import run_multidevice

  out = run_multidevice("""
      import contextlib, io, jax
      from jaxagent import config
      from jaxagent.run_services import run_meshes
      said = io.StringIO()
      with contextlib.redirect_stderr(said):
        mesh, _ = run_meshes(config.MeshConfig(data=2), "")
      print(mesh.devices.size, "the rest are idle" in said.getvalue())
      jax.process_count = lambda: 2
      try:
        run_meshes(config.MeshConfig(data=2), "")
      except config.ConfigError as e:
        print(e)
      """, devices=4)
  first, refused = out.strip().splitlines()
  assert first == "2 True"
  assert refused.startswith("mesh.data x mesh.fsdp x mesh.tensor is 2 devices, of the 4 the "
                            "learner has: a multi-process learner spans every"), refused


def test_a_learner_temperature_the_run_ignores_is_said():
  """`learner.temperature` was replaced by the agent's without a word (a reviewer); a
  note, not an error, so that a run saved with one still resumes."""
  from jaxagent.run_checks import ignored_temperature

  tiny = os.path.join(REPO, "configs/tiny.yaml")
  assert ignored_temperature(config.load(config.RunConfig, tiny, [])) is None
  assert ignored_temperature(config.load(config.RunConfig, tiny, [
      "learner.temperature=0.7", "agent.temperature=0.7"])) is None
  said = ignored_temperature(config.load(config.RunConfig, tiny, ["learner.temperature=0.7"]))
  assert said.startswith("learner.temperature (0.7) is ignored"), said
