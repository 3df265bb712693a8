"""Exact values across the sandbox boundary: a typed JSON encoding of plain Python data.

The grader never compares a solution's return value inside the solution's
process (where `__eq__` can be overridden and the comparison itself patched).
The sandboxed side encodes what the function returned, accepting only exact
built-in types (a subclass of `int` or an object with a forged `__eq__` is
refused; a dict subclass is read as the dict it holds); the host decodes it and compares it with the expected value by type
and value (`strict_equal`: `True` is not `1`, `(1,)` is not `[1]`).

This module's source is also sent, as is, into the sandbox as part of the
grading harness (`envs.verifier`), so it uses nothing but the standard library
and no names from elsewhere in the project.
"""

import json
import math

MAX_DEPTH = 32
# The deepest JSON nesting an encoded value of MAX_DEPTH reaches (a dict level is three:
# the tagged pair, its items, an item), with room for the result line around it.
MAX_JSON_DEPTH = 3 * MAX_DEPTH + 12


def json_depth(data) -> int:
  """How deep lists and dicts nest in parsed JSON, counted without recursion (a value
  nested near the interpreter's recursion limit must not raise where it is measured)."""
  deepest, stack = 0, [(data, 1)]
  while stack:
    x, d = stack.pop()
    if isinstance(x, (list, dict)):
      deepest = max(deepest, d)
      stack.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x))
  return deepest


def encode(value, depth=0):
  """`value` as JSON-able data tagged with its exact type; TypeError for anything else."""
  if depth > MAX_DEPTH:
    raise ValueError("value nested too deeply")
  t = type(value)
  if value is None:
    return ["none"]
  if t is bool:
    return ["bool", value]
  if t is int:
    return ["int", str(value)]  # arbitrary size
  if t is float:
    return ["float", repr(value)]  # nan and inf too
  if t is str:
    return ["str", value]
  if t is bytes:
    return ["bytes", value.hex()]
  if t is list or t is tuple:
    return [t.__name__, [encode(v, depth + 1) for v in value]]
  if t is set or t is frozenset:
    items = [encode(v, depth + 1) for v in value]
    return [t.__name__, sorted(items, key=json.dumps)]
  if issubclass(t, dict):
    # A dict subclass (Counter, defaultdict, OrderedDict: a right answer to "a dict
    # mapping ...") grades as the dict it holds, read by dict's own method so no
    # override of `items` or `__getitem__` can change what is read.
    items = [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in dict.items(value)]
    return ["dict", sorted(items, key=lambda kv: json.dumps(kv[0]))]
  raise TypeError(f"cannot grade a value of type {t.__name__}")


def decode(data, depth=0):
  """The value `encode` described; ValueError for anything malformed."""
  if depth > MAX_DEPTH or not isinstance(data, list) or not data or not isinstance(data[0], str):
    raise ValueError("malformed value")
  tag, rest = data[0], data[1:]
  if tag == "none" and not rest:
    return None
  if len(rest) != 1:
    raise ValueError(f"malformed {tag!r} value")
  (x,) = rest
  if tag == "bool" and type(x) is bool:
    return x
  if tag == "int" and type(x) is str and len(x) <= 5000:
    return int(x)
  if tag == "float" and type(x) is str:
    return float(x)
  if tag == "str" and type(x) is str:
    return x
  if tag == "bytes" and type(x) is str:
    return bytes.fromhex(x)
  if tag in ("list", "tuple", "set", "frozenset") and type(x) is list:
    items = [decode(v, depth + 1) for v in x]
    if tag in ("set", "frozenset"):
      _unflooded(items, tag)
    return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
  if tag == "dict" and type(x) is list:
    if any(type(kv) is not list or len(kv) != 2 for kv in x):
      raise ValueError("malformed dict item")
    keys = [decode(kv[0], depth + 1) for kv in x]
    _unflooded(keys, "dict")
    return dict(zip(keys, [decode(kv[1], depth + 1) for kv in x]))
  raise ValueError(f"malformed {tag!r} value")


# Items of one set (keys of one dict) whose hashes may be equal: a few distinct values
# share one (hash(-1) == hash(-2)); thousands are made to (multiples of 2**61 - 1 all hash
# to 0), and building their set takes time quadratic in their count.
MAX_EQUAL_HASHES = 16


def _unflooded(items, tag):
  """ValueError where more than MAX_EQUAL_HASHES of `items` hash alike: their set, built
  on the grader's host, took seconds holding its interpreter (29,000 ints in a 1 MiB
  line: 4.5 s of every episode's time on that host; a red team)."""
  counts = {}
  for item in items:
    h = hash(item)
    counts[h] = counts.get(h, 0) + 1
    if counts[h] > MAX_EQUAL_HASHES:
      raise ValueError(f"a {tag} of {len(items)} items of which more than "
                       f"{MAX_EQUAL_HASHES} hash alike: refused (made to be slow to build)")


def strict_equal(a, b, rel_tol=1e-9, abs_tol=1e-12):
  """Equal in type and value, all the way down; floats within a tolerance."""
  if type(a) is not type(b):
    return False
  if type(a) is float:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rel_tol,
                                                             abs_tol=abs_tol)
  if type(a) in (list, tuple):
    return len(a) == len(b) and all(strict_equal(x, y) for x, y in zip(a, b))
  if type(a) is dict:
    # Keys match exactly, all the way down, as set items do (`==` took (True, 2.0) for
    # (1, 2)); values strictly.
    keys_a, keys_b = ({json.dumps(encode(k)): k for k in d} for d in (a, b))
    return len(a) == len(b) and keys_a.keys() == keys_b.keys() and all(
        strict_equal(a[keys_a[e]], b[keys_b[e]]) for e in keys_a)
  if type(a) in (set, frozenset):
    return sorted(map(json.dumps, map(encode, a))) == sorted(map(json.dumps, map(encode, b)))
  return a == b
