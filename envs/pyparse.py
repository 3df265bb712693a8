"""Python's parser for host-side checks, one thread at a time.

CPython 3.11's AST constructor keeps its recursion depth in interpreter-wide state:
two threads building trees at once (a worker's concurrent verifies run their source
checks in threads; a calculator step parses on the event loop meanwhile) can corrupt
it when the garbage collector runs inside one of them and lets the other in, and the
parse raises `SystemError: AST constructor recursion depth mismatch` (CPython
gh-106905), which would turn a policy's answer into an infrastructure error (red team
16). The parses are CPU-bound under the GIL anyway: one at a time costs nothing.
"""

import ast
import threading

_LOCK = threading.Lock()


def parse(source: str, mode: str = "exec") -> ast.AST:
  """`ast.parse(source, mode=mode)`, never at once with another thread's."""
  with _LOCK:
    return ast.parse(source, mode=mode)
