"""`python -m jaxagent.export_hf`: a trained policy as a Hugging Face checkpoint that
transformers loads with our logits and our tokens."""

import dataclasses
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from jaxagent import config as config_lib  # noqa: E402
from jaxagent.checkpoint import export_policy  # noqa: E402
from jaxagent.export_hf import main  # noqa: E402
from jaxagent.models.config import RopeScaling, preset  # noqa: E402
from jaxagent.models.hf import load_hf, save_hf  # noqa: E402
from jaxagent.models.params import abstract_model, bind, init_params  # noqa: E402
from jaxagent.tokenizer import Tokenizer  # noqa: E402
from tests.conftest import REPO  # noqa: E402


def _random(cfg, seed=0):
  """Parameters with every entry random (biases and norms too, so each is checked)."""
  rng = np.random.default_rng(seed)
  return {k: rng.normal(0, 0.3, v.shape).astype(np.float32)
          for k, v in init_params(cfg, seed).items()}


def _logits(cfg, params, ids):
  graphdef, state = abstract_model(cfg)
  ours, _ = bind(graphdef, state, {k: jnp.asarray(v) for k, v in params.items()})(
      jnp.asarray(ids))
  return np.asarray(ours)


def test_a_trained_runs_policy_loads_in_transformers(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(REPO)
  run = tmp_path / "run"
  run.mkdir()
  cfg = config_lib.load(config_lib.RunConfig, "configs/tiny.yaml")
  (run / "config.json").write_text(json.dumps(config_lib.to_dict(cfg)))
  model_cfg = preset("nano")
  params = _random(model_cfg)
  export_policy(str(run / "policy"), 3, params, dtype=None)

  out = tmp_path / "hf"
  assert main(["--policy", str(run / "policy"), "--out", str(out), "--dtype", "float32"]) == 0
  said = capsys.readouterr().out
  assert said.startswith("policy v3 (LlamaForCausalLM, 147,776 parameters, float32)"), said
  # Read back exactly, by our loader and by transformers (the same logits).
  _, back = load_hf(str(out))
  for name, value in params.items():
    np.testing.assert_array_equal(np.asarray(back[name]), value, err_msg=name)
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
  ids = np.random.default_rng(1).integers(0, model_cfg.vocab_size, (2, 24))
  with torch.no_grad():
    expected = hf(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(_logits(model_cfg, params, ids), expected, atol=1e-4, rtol=1e-4)
  # The tokenizer and the chat template the run trained with: the same text and ids.
  ours = Tokenizer.byte_level()
  theirs = transformers.AutoTokenizer.from_pretrained(str(out))
  chat = [{"role": "system", "content": "Guess the number."},
          {"role": "user", "content": "Between 1 and 16: 12?"}]
  assert theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
      ours.render(chat)
  assert list(theirs.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]) == \
      ours.apply_chat_template(chat)
  assert theirs.encode("café 42") == ours.encode("café 42")
  generation = json.loads((out / "generation_config.json").read_text())
  assert set(generation["eos_token_id"]) == set(ours.stop_ids)

  # Never over a checkpoint; no run config: one line each.
  assert main(["--policy", str(run / "policy"), "--out", str(out)]) == 2
  assert "is not empty" in capsys.readouterr().err
  assert main(["--policy", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 2
  assert "--policy: no such export" in capsys.readouterr().err  # (a new user: it said "no
  # config.json in the run directory above" a path that does not exist)
  (tmp_path / "bare").mkdir()
  assert main(["--policy", str(tmp_path / "bare"), "--out", str(tmp_path / "x")]) == 2
  assert "no config.json in the run directory" in capsys.readouterr().err
  assert not (tmp_path / "x").exists()  # (made for the export, removed when none came)
  # A directory that cannot be made is named as --out's (/proc: root's modes allow it).
  for bad, said in (("/proc/nope", "--out: cannot write the directory /proc/nope ("),
                    (str(tmp_path / "bare" / "config.json" / "d"), "--out: cannot write")):
    if bad.startswith(str(tmp_path)):
      (tmp_path / "bare" / "config.json").write_text("{}")
    assert main(["--policy", str(run / "policy"), "--out", bad]) == 2
    assert said in capsys.readouterr().err
  # A config of a model preset not known: named (a KeyError's traceback: a red team)
  (tmp_path / "typo.yaml").write_text("model:\n  preset: nosuch\n")
  assert main(["--policy", str(run / "policy"), "--config", str(tmp_path / "typo.yaml"),
               "--out", str(tmp_path / "y")]) == 2
  err = capsys.readouterr().err.strip()
  assert "model.preset: unknown 'nosuch'" in err and len(err.splitlines()) == 1, err


def test_qwen2_biases_and_llama3_rope_export_in_bfloat16(tmp_path):
  from safetensors import safe_open

  cfg = dataclasses.replace(preset("nano"), qkv_bias=True, tie_embeddings=False,
                            rope_scaling=RopeScaling(original_max_position=32))
  params = _random(cfg, seed=2)
  save_hf(str(tmp_path), cfg, params, "bfloat16")
  # The weights as readable as the config (safetensors wrote them 0600: a new user's round).
  assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == \
      (tmp_path / "config.json").stat().st_mode & 0o777
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["architectures"] == ["Qwen2ForCausalLM"] and config["torch_dtype"] == "bfloat16"
  with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
    assert str(f.get_tensor("model.layers.0.self_attn.q_proj.bias").dtype) == "bfloat16"
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
  ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (1, 40))  # past 32: scaled
  with torch.no_grad():
    expected = hf.eval()(torch.tensor(ids)).logits.numpy()
  _, back = load_hf(str(tmp_path))  # the bfloat16 weights, as transformers read them
  np.testing.assert_allclose(_logits(cfg, {k: np.asarray(v) for k, v in back.items()}, ids),
                             expected, atol=1e-3, rtol=1e-3)
  # A shape Qwen2 cannot hold is refused before anything is written.
  odd = dataclasses.replace(cfg, head_dim=8)
  with pytest.raises(ValueError, match="head_dim is d_model / n_heads"):
    save_hf(str(tmp_path / "odd"), odd, _random(odd), "bfloat16")
  assert not os.path.exists(tmp_path / "odd")
