"""Argument types for command lines (the tools' benchmarks), and the commands' console
logging. A bad value is argparse's one-line error naming the flag (`error: argument
--seq-lens: ...`), not a traceback from deep in the run (`--presets nope` was a KeyError,
`--seq-lens abc` a ValueError, `--turns 0` a ZeroDivisionError: a new user)."""

from __future__ import annotations

import argparse
import logging
from typing import Callable


def positive_int(text: str) -> int:
  """An integer >= 1."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"an integer >= 1, got {text!r}") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
  return value


def positive_float(text: str) -> float:
  """A finite number > 0."""
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"a number > 0, got {text!r}") from None
  if not 0 < value < float("inf"):
    raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
  return value


def positive_ints(text: str) -> list[int]:
  """Comma-separated integers >= 1 (`1024,8192`)."""
  items = [t.strip() for t in text.split(",")]
  if not all(items):
    raise argparse.ArgumentTypeError(f"comma-separated integers >= 1, got {text!r}")
  return [positive_int(t) for t in items]


def names_of(known, what: str) -> Callable[[str], list[str]]:
  """A type for comma-separated names, each one of `known` (an iterable read when the
  argument is parsed)."""

  def parse(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",")]
    allowed = sorted(known)
    for name in names:
      if name not in allowed:
        raise argparse.ArgumentTypeError(f"unknown {what} {name!r}; known: "
                                         f"{', '.join(allowed)}")
    return names

  return parse


class _Said(logging.Formatter):
  """`warning: <message>`, as the commands' own lines read (the default was
  `WARNING:rollout_server.router:router: ...`, a logger's name the message repeats)."""

  def format(self, record: logging.LogRecord) -> str:
    text = f"{record.levelname.lower()}: {record.getMessage()}"
    if record.exc_info:
      text += "\n" + self.formatException(record.exc_info)
    return text


def log_to_console() -> None:
  """Logging's warnings and errors on stderr as `warning: ...` lines, for a command's
  `main`: a root handler of this shape (an imported library's own, absl's through Orbax,
  re-shaped), installed before one that would set up its own at first use."""
  root = logging.getLogger()
  if not root.handlers:
    root.addHandler(logging.StreamHandler())
  for handler in root.handlers:
    if type(handler) is logging.StreamHandler:
      handler.setFormatter(_Said())
