"""Logits of our decoder equal Hugging Face transformers' for the same random weights."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from jaxagent.models.hf import load_hf  # noqa: E402
from jaxagent.models.params import abstract_model, bind  # noqa: E402
from jaxagent.models.sharding import make_mesh  # noqa: E402

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=128, rms_norm_eps=1e-6)

CASES = {
    # grouped-query attention, untied head
    "llama_gqa": (transformers.LlamaConfig, dict(num_key_value_heads=2, rope_theta=10000.0,
                                                  tie_word_embeddings=False)),
    # Llama 3 rope scaling, tied embeddings, multi-query
    "llama3_rope_tied": (transformers.LlamaConfig, dict(
        num_key_value_heads=1, rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    # Qwen2: q/k/v bias, GQA, tied embeddings
    "qwen2_bias_tied": (transformers.Qwen2Config, dict(num_key_value_heads=2,
                                                       rope_theta=1e6, tie_word_embeddings=True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
  config_cls, extra = CASES[case]
  torch.manual_seed(0)
  hf_cfg = config_cls(**COMMON, **extra)
  hf_model = transformers.AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=torch.float32)
  with torch.no_grad():  # random biases, so the bias path is really exercised
    for name, p in hf_model.named_parameters():
      if name.endswith("bias"):
        p.normal_(0.0, 0.5)
  hf_model.eval()
  hf_model.save_pretrained(tmp_path, safe_serialization=True)

  cfg, params = load_hf(str(tmp_path), mesh=make_mesh())
  assert cfg.qkv_bias == (case == "qwen2_bias_tied")
  assert cfg.tie_embeddings == extra["tie_word_embeddings"]
  assert params["wq"].sharding.mesh is not None  # placed with the mesh's shardings
  graphdef, state = abstract_model(cfg)
  model = bind(graphdef, state, params)

  tokens = np.random.default_rng(0).integers(0, COMMON["vocab_size"], (2, 40))
  with torch.no_grad():
    expected = hf_model(torch.tensor(tokens)).logits.numpy()
  ours, _ = model(jnp.asarray(tokens))
  np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-4, rtol=1e-4)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    load_hf(str(tmp_path))


@pytest.mark.parametrize("extra, refused", [
    (dict(attention_bias=True), "a Llama's attention_bias"),
    (dict(mlp_bias=True), "mlp_bias is not supported"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported")])
def test_a_llama_of_a_kind_this_model_does_not_compute_is_refused(extra, refused, tmp_path):
  """A reviewer: a Llama with an output bias, MLP biases or another activation loaded
  without a word (its logits off by about their own size): refused by name; and weights
  a checkpoint holds that no parameter reads are refused, not dropped."""
  from safetensors.numpy import save_file

  hf_cfg = transformers.LlamaConfig(**COMMON, num_key_value_heads=2, **extra)
  hf_model = transformers.AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=torch.float32)
  hf_model.save_pretrained(tmp_path, safe_serialization=True)
  with pytest.raises(ValueError, match=refused):
    load_hf(str(tmp_path))
  plain = tmp_path / "plain"
  transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
      **COMMON, num_key_value_heads=2), torch_dtype=torch.float32).save_pretrained(
      plain, safe_serialization=True)
  load_hf(str(plain))
  save_file({"model.layers.0.mlp.gate_proj.bias": np.zeros(96, np.float32)},
            str(plain / "extra.safetensors"))
  with pytest.raises(ValueError, match="1 tensors this model does not compute.*gate_proj"):
    load_hf(str(plain))
