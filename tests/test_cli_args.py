"""The tools' command lines refuse a bad value with argparse's line naming the flag (a new
user met a KeyError, a ValueError and a ZeroDivisionError traceback)."""

import argparse
import subprocess
import sys

import pytest

from jaxagent.cli_args import names_of, positive_float, positive_int, positive_ints
from tests.conftest import REPO


def test_types_take_what_they_say_and_name_what_they_refuse():
  assert positive_int("3") == 3 and positive_ints("1024, 8192") == [1024, 8192]
  assert positive_float("0.5") == 0.5
  assert names_of({"tiny", "nano"}, "model preset")("tiny,nano") == ["tiny", "nano"]
  for parse, text, needle in ((positive_int, "0", "must be >= 1, got 0"),
                              (positive_int, "abc", "an integer >= 1, got 'abc'"),
                              (positive_ints, "1,,2", "comma-separated integers >= 1"),
                              (positive_ints, "8,-1", "must be >= 1, got -1"),
                              (positive_float, "nan", "must be a number > 0"),
                              (positive_float, "inf", "must be a number > 0"),
                              (names_of({"tiny"}, "model preset"), "nope",
                               "unknown model preset 'nope'; known: tiny")):
    with pytest.raises(argparse.ArgumentTypeError, match=needle):
      parse(text)


@pytest.mark.parametrize("argv, needle", [
    (["tools/bench_wal.py", "--turns", "0", "--json"], "argument --turns: must be >= 1, got 0"),
    (["tools/bench_learner.py", "--seq-lens", "abc"],
     "argument --seq-lens: an integer >= 1, got 'abc'"),
    (["tools/bench_rollout.py", "--presets", "nope"],
     "argument --presets: unknown model preset 'nope'; known:"),
])
def test_a_benchmark_refuses_a_bad_flag_in_one_line(argv, needle):
  r = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True,
                     timeout=120)
  assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_commands_warnings_read_as_its_own_lines_whatever_set_logging_up_first():
  """Orbax's import sets up logging (absl's `basicConfig`): a router's warning in a training
  run read `WARNING:rollout_server.router:router: ...` (a new user). A command's `main`
  shapes it as its own lines, and a library's later setup keeps that shape."""
  code = ("import logging, orbax.checkpoint\n"
          "from jaxagent.cli_args import log_to_console\n"
          "log_to_console()\n"
          "logging.basicConfig()\n"
          "logging.getLogger('rollout_server.router').warning('router: %s gone', 'b1')\n"
          "logging.getLogger('envs.pool').info('not said')\n")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stderr == "warning: router: b1 gone\n"
