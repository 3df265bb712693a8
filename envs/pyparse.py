"""Python's parser for host-side checks, one thread at a time.

CPython 3.11's AST constructor keeps its recursion depth in interpreter-wide state:
two threads building trees at once (a worker's concurrent verifies run their source
checks in threads; a calculator step parses on the event loop meanwhile) can corrupt
it when the garbage collector runs inside one of them and lets the other in, and the
parse raises `SystemError: AST constructor recursion depth mismatch` (CPython
gh-106905), which would turn a policy's answer into an infrastructure error (red team
16). The parses here are CPU-bound under the GIL anyway: one at a time costs nothing.

Python's own traceback formatting parses too (3.11 draws its `~~~^~~~` carets from
the failing line's tree: a reviewer's finding, a worker's error log meeting a
verify's check): importing this module puts that parse under the same lock. A parse
that meets a mismatch anyway (another library's) is made again: the count starts
afresh at each.
"""

import ast
import functools
import threading
import traceback

_LOCK = threading.RLock()
_MISMATCH = "AST constructor recursion depth mismatch"
TRIES = 5


def parse(source: str, mode: str = "exec") -> ast.AST:
  """`ast.parse(source, mode=mode)`, never at once with another under this lock."""
  with _LOCK:
    for attempt in range(TRIES):
      try:
        return ast.parse(source, mode=mode)
      except SystemError as e:
        if _MISMATCH not in str(e) or attempt == TRIES - 1:
          raise
  raise AssertionError("unreachable")


def _locked(fn):
  @functools.wraps(fn)
  def call(*args, **kwargs):
    with _LOCK:
      return fn(*args, **kwargs)

  call.under_pyparse_lock = True
  return call


_CARETS = "_extract_caret_anchors_from_line_segment"  # (3.11's; 3.13 renamed it)
if hasattr(traceback, _CARETS) and not hasattr(getattr(traceback, _CARETS),
                                               "under_pyparse_lock"):
  setattr(traceback, _CARETS, _locked(getattr(traceback, _CARETS)))
