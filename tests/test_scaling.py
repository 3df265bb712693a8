"""tools/scaling.py: its memory formulas agree with what JAX allocates (tiny presets),
and its plans for the large presets carry the known figures."""

import importlib.util
import sys

from tests.conftest import REPO


def _scaling():
  spec = importlib.util.spec_from_file_location("scaling", f"{REPO}/tools/scaling.py")
  mod = importlib.util.module_from_spec(spec)
  sys.modules["scaling"] = mod  # dataclasses look their module up
  spec.loader.exec_module(mod)
  return mod


def test_formulas_match_jax_on_the_nano_preset():
  (r,) = _scaling().check_against_jax(("nano",))
  assert r["state_bytes_formula"] == r["state_bytes_jax"]
  assert r["kv_bytes_per_token_formula"] == r["kv_bytes_per_token_jax"]
  # XLA's temporaries are within the margin the plans budget.
  assert 1 / _scaling().ACTIVATION_MARGIN <= r["activation_over_xla"] <= 1.0


def test_plans_for_7b_and_70b():
  s = _scaling()
  p7 = s.plan("qwen2.5-7b", "v5p", 32, 8192)
  p70 = s.plan("llama-3.1-70b", "v5p", 256, 32768)
  assert p7.params_b == 7.616 and p70.params_b == 70.554
  assert p7.kv_kib_per_token == 56.0 and p70.kv_kib_per_token == 320.0
  assert p7.fits and p7.sync_gb == 15.23
  # Longer episodes: fewer sequences per rollout chip, more rollout chips per learner chip.
  p7_long = s.plan("qwen2.5-7b", "v5p", 32, 32768)
  assert p7_long.sequences_per_rollout_chip < p7.sequences_per_rollout_chip
  assert p7_long.rollout_to_learner_chips > p7.rollout_to_learner_chips


def test_bad_arguments_are_one_line(monkeypatch, capsys):
  """A ZeroDivisionError (--learner-chips 0) and a KeyError traceback (--models nosuch)
  before (a new user's round)."""
  import pytest

  s = _scaling()
  for argv, needle in ((["--learner-chips", "0"], "must be >= 1"),
                       (["--models", "nosuch"], "--models: unknown nosuch; known:"),
                       (["--episode-tokens", "8k"], "whole numbers")):
    monkeypatch.setattr(sys, "argv", ["scaling.py", *argv])
    with pytest.raises(SystemExit) as e:
      s.main()
    assert e.value.code == 2 and needle in capsys.readouterr().err, argv
