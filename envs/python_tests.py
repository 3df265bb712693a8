"""`python_tests`: write a Python function so that hidden unit tests pass.

Tools run in the episode's sandbox: `write_file`, `run_python` and
`run_public_tests`. The episode ends when the model answers without a tool
call (for example "DONE") or runs out of turns. `verify()` grades the final
files against the hidden cases in a fresh workspace (`envs.verifier`); the
verdict's reward (1 for a pass) is the episode's reward. Files the tools write
are capped (`Limits.write_bytes`) and written off the event loop.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import concurrent.futures
import dataclasses
import difflib
import functools
import hashlib
import inspect
import json
import keyword
import math
import os
import re
import stat
import textwrap
import unicodedata
from typing import Optional

from envs import pyparse, values, waits
from envs.base import (Env, EnvResources, Observation, StepResult, TaskSpec, Verdict,
                       VerdictStatus, register, task_int, task_known)
from envs.python_tasks_data import TASKS, _function_name, as_tests
from envs.hostfs import MAX_PATH_CHARS
from envs.tools import Tool, ToolSet, echoed
from envs.sandbox import WorkspaceTooLarge
from envs.verifier import MAX_REPORT_BYTES, HiddenTests, PythonTestVerifier, report_bytes
from jaxagent.errors import InfraError

PUBLIC_TESTS = "test_public.py"
SYSTEM = ("Write Python in the file solution.py using the write_file tool. You can run code "
          "with run_python and check your work with run_public_tests. Reply DONE when "
          "finished.")
BY_NAME = {t[0]: t for t in TASKS}
OWN_PARAMS = ("prompt", "function", "tests", "public_test", "reference", "max_turns")


def task_spec(task: TaskSpec) -> tuple[tuple, str]:
  """A task's (name, description, reference solution, public test, hidden cases) and its
  function's name: a bundled task by `params.task`, or the task file's own (`prompt`,
  `function`, `tests`: [[args], expected] pairs, compared by type and value, so a JSON
  list expects a list; optional `public_test`, code the model may run, by default a
  check of the first case where there are several (`default_public_test`), and
  `reference`, a solution `envs.filter` checks). A bad one is a ValueError naming what
  (an own task was "unknown python_tests task None": a new user)."""
  p = task.params
  if "task" in p:
    task_known(p, ("task", "max_turns"), task.id)
    name = p["task"]
    if name not in BY_NAME:
      near = difflib.get_close_matches(str(name), sorted(BY_NAME), n=1)
      raise ValueError(f"task {task.id}: unknown python_tests task {name!r}"
                       + (f" (did you mean {near[0]!r}?)" if near else "")
                       + f"; bundled: {', '.join(sorted(BY_NAME))} (a task of your own gives "
                       "prompt, function and tests instead)")
    return BY_NAME[name], _function_name(BY_NAME[name][2])
  task_known(p, OWN_PARAMS, task.id)
  missing = [k for k in ("prompt", "function", "tests") if k not in p]
  if missing:
    raise ValueError(f"task {task.id}: a python_tests task names a bundled one (task) or "
                     f"gives its own prompt, function and tests: {', '.join(missing)} missing")
  prompt, fn, tests = p["prompt"], p["function"], p["tests"]
  if not isinstance(prompt, str) or not prompt.strip():
    raise ValueError(f"task {task.id}: prompt must be a non-empty string")
  try:
    prompt.encode()
  except UnicodeError:  # (a JSON escape of half a character: the policy saw it)
    raise ValueError(f"task {task.id}: prompt is not text (a lone surrogate)") from None
  if not (isinstance(fn, str) and fn.isidentifier() and fn.isascii()
          and not keyword.iskeyword(fn)):
    raise ValueError(f"task {task.id}: function must be a Python name, got {fn!r:.80}")
  if not isinstance(tests, list) or not tests:
    raise ValueError(f"task {task.id}: tests must be a non-empty list of [[args], expected]")
  cases, encoded = [], []
  for i, case in enumerate(tests):
    if not (isinstance(case, list) and len(case) == 2 and isinstance(case[0], list)):
      raise ValueError(f"task {task.id}: tests[{i}] must be [[args], expected], got "
                       f"{case!r:.80}")
    try:
      values.encode(tuple(case[0]))
      encoded.append(values.encode(case[1]))
    except (TypeError, ValueError) as e:
      raise ValueError(f"task {task.id}: tests[{i}]: {e}") from None
    cases.append((tuple(case[0]), case[1]))
  takes = report_bytes(encoded)
  if takes > MAX_REPORT_BYTES:  # (a correct answer's results overflow: it never passes)
    raise ValueError(f"task {task.id}: tests: a correct answer's results take about {takes} "
                     f"bytes, more than the grader reads ({MAX_REPORT_BYTES}): fewer or "
                     "smaller cases")
  # (by default a check of the first case: of a task's only case, none, or the answer
  # written back passed it: a reviewer)
  public = p["public_test"] if "public_test" in p else (
      default_public_test(fn, cases) if len(cases) > 1 else "")
  reference = p.get("reference", "")
  for field, code in (("public_test", public), ("reference", reference)):
    if not isinstance(code, str):
      raise ValueError(f"task {task.id}: {field} must be a string of Python")
    if len(code.encode("utf-8", "surrogatepass")) > MAX_OWN_CODE_BYTES:
      raise ValueError(f"task {task.id}: {field} is over {MAX_OWN_CODE_BYTES} bytes")
    try:
      code.encode()
      ast.parse(code)
    except SyntaxError as e:
      raise ValueError(f"task {task.id}: {field} is not Python: {e.msg}"
                       + (f" (line {e.lineno})" if e.lineno else "")) from None
    except (ValueError, UnicodeError) as e:  # (a lone surrogate, a NUL: Python's text)
      raise ValueError(f"task {task.id}: {field} is not Python: {e}"[:300]) from None
  return (task.id, prompt, reference, public, cases), fn


MAX_OWN_CODE_BYTES = 64 << 10  # of a task's own public test or reference (the public test
# is in the prompt)
DEFAULT_PUBLIC_CHARS = 1000  # the longest default public test (the prompt shows it)


GRADING = "_grading.py"  # the grader's comparison, for the default public test


@functools.cache
def grading_module() -> str:
  """`_grading.py`: the grader's own codec and comparison (`envs.values`, which the
  harness carries into the sandbox too), and `graded_equal(got, expected)`, what the
  hidden tests ask of each case."""
  return (inspect.getsource(values) + "\n\ndef graded_equal(got, expected):\n"
          "  \"\"\"Whether `got` passes for `expected` as the hidden tests compare: type and "
          "value, floats within 1e-9.\"\"\"\n"
          "  return strict_equal(decode(json.loads(json.dumps(encode(got)))), expected)\n")


def checker_name(fn: str) -> str:
  """The default public test's comparison's name: `graded_equal`, unless that is the
  task's function's."""
  return "graded_equal" if fn != "graded_equal" else "graded_equal_"


def default_public_test(fn: str, cases: list) -> str:
  """An own task's public test by default: its first case whose test is short (a case of
  300,000 numbers made a 2 MB test file, refused as the episode began), compared as the
  grader compares (`==` passed 3.0 for 6 and failed 0.1 + 0.2 for 0.3, which the grader
  passes; a test's own names shadowed a function named `result` or `math`); none where no
  case's is short."""
  check = checker_name(fn)
  for args, expected in cases:
    test = f"assert {check}({fn}({', '.join(map(_literal, args))}), {_literal(expected)})"
    if len(test) <= DEFAULT_PUBLIC_CHARS:
      return test
  return ""


def _literal(value) -> str:
  """`value` as Python reads it back (a float that is not finite too)."""
  if type(value) is float and not math.isfinite(value):
    return f"float({str(value)!r})"
  return repr(value)


def judged_answer(files: dict[str, bytes]) -> str:
  """What a judge is shown of a solution: every file the tests ran with, named
  (solution.py first), so nothing the tests used is hidden from it. Each file starts
  after a header line tagged from a hash of them all, which no file can write ahead of
  time: a `### test_public.py` line inside solution.py cannot pass for a file of its own."""
  names = sorted(files, key=lambda n: (n != "solution.py", n))
  # Line ends as Python reads them (a lone carriage return ends a line there, so code
  # after one in a comment runs): the judge sees the lines that run.
  texts = [files[n].decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n")
           for n in names]
  tag = "FILE-" + hashlib.sha256(json.dumps([names, texts]).encode()).hexdigest()[:12]
  return (f"{len(names)} file(s), each after a line '{tag} <name>':\n\n"
          + "\n\n".join(f"{tag} {n}\n{t}" for n, t in zip(names, texts)))


# Characters whose NFKC form draws as they do: Thai's and Lao's SARA AM (in most words
# that count or hold a vowel "am": Thai prose was refused). A name holding one is the
# name a reader sees either way.
_DRAWN_AS_FOLDED = frozenset("\u0e33\u0eb3")


def _unnormalized_char(text: str) -> Optional[str]:
  """A character that Python, in a name, reads as another (it folds identifiers to NFKC:
  a `def` in mathematical bold letters rebinds the plain name), or None. Looked for
  anywhere in the text, not by tokens: an f-string or a character the tokenizer does
  not know would hide it from them."""
  for ch in sorted({c for c in text if ord(c) > 127} - _DRAWN_AS_FOLDED):
    if ("a" + ch).isidentifier() and unicodedata.normalize("NFKC", ch) != ch:
      return ch
  return None


# The fields of Python's syntax tree that hold names (a variable, function, class,
# argument, attribute, import and module imported from, keyword, handler, match
# capture); lists of names too.
_NAME_FIELDS = ("id", "name", "attr", "arg", "asname", "module", "rest", "names",
                "kwd_attrs")
# Characters a reader does not see (Unicode's Default_Ignorable_Code_Point: fillers,
# variation selectors and format characters, some of which names may hold).
_INVISIBLE = re.compile(
    "[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f"
    "\u202a-\u202e\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufff8"
    "\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e0fff]")


@functools.cache
def _ascii_alike() -> dict[int, str]:
  """Each character Unicode's confusables table draws like ASCII letters or digits (one,
  or a digraph's two: `ʦ` as ts, `ǁ` as ll), and the Latin small capitals and insular
  letters the table leaves out (`ᴀ` as a; red team 32)."""
  from confusable_homoglyphs.confusables import confusables_data

  out = {}
  for char, alike in confusables_data.items():
    # (a letter of Western Europe's own alphabets is not its two ASCII letters: a French
    # `nœud` beside a name `noeud`, a Danish `værdi` beside `vaerdi`, are words apart)
    ascii_ = sorted((a["c"] for a in alike if a["c"].isascii() and a["c"].isalnum()
                     and (len(a["c"]) == 1 or len(char) == 1 and ord(char) > 0x17F)),
                    key=len)
    if len(char) == 1 and not char.isascii() and ascii_:
      out[ord(char)] = ascii_[0]
  for code in range(0x80, 0x20000):
    name = unicodedata.name(chr(code), "")
    m = ("LATIN" in name and re.fullmatch(
        r"LATIN (?:LETTER SMALL CAPITAL|SMALL LETTER INSULAR) ([A-Z])", name))
    if m and code not in out:
      out[code] = m.group(1).lower()
  return out


def _as_read(name: str, marks: bool = False) -> str:
  """`name` as a reader sees it: invisible characters dropped, a dot above an i or a j
  (drawn as its own dot) dropped, letters drawn like ASCII ones taken for them, and
  (unless `marks`) the combining marks other than the Latin accents (U+0300-U+036F,
  which prose's words hold and a reader sees) dropped: a Khitan filler or a joiner
  draws as nothing or a speck, and is not Default_Ignorable (red team 31)."""
  name = _INVISIBLE.sub("", unicodedata.normalize("NFD", name))
  name = re.sub("(?<=[ijıȷ])\u0307", "", name)
  if not marks:
    name = "".join(c for c in name if unicodedata.category(c) != "Mn"
                   or "\u0300" <= c <= "\u036f")
  return unicodedata.normalize("NFC", name).translate(_ascii_alike())


# Letters many fonts draw alike, folded before readings are compared (UTS #39 takes I,
# 1 and | for l; the confusables table takes a Cyrillic palochka for i and a Cyrillic
# І for l, so `heӏper` and `heІper` read as two names: a reviewer of red team 31).
_ALIKE = str.maketrans("I1|i", "llll")


def _called_twin(uses: "_Uses", bound: list) -> Optional[tuple[str, str]]:
  """A name code uses as a callable that reads as another callable, or None: the
  judge reads the one as the other, however it came to be bound (at run time on
  builtins, an instance, a module's or a metaclass's `__getattr__`, a `__builtins__`
  of its own, an argument's default, or only while a call runs: red teams 33 and 34,
  each past every reading of names at run time). Compared:
  - a name the code calls, decorates with, or hands a function that takes a function
    (`map`, `reduce`, `partial`, a `key=`), and one the files define as a callable
    (def, class, import, an argument whose default is a function) with the builtins
    (`surn` as `sum`, `s0rted`, `povv`, `rouncl`, `staticrnethod`);
  - a name the code reads that no code binds, and one it calls, with the callables
    the files define (`functools.reduce(helpers.heIper, ...)` beside `def helper`);
  - the callables the files define with each other (`c0mpute` beside `compute`).
  0 and o, vv and w read alike there too, and cl and d beside a builtin's name. A name
  only read (a matrix entry `a11` beside the builtin `all`) is not compared with the
  builtins. `bound`: the names code binds (`_bound`)."""
  def read(name: str, builtin: bool = False) -> str:
    name = name.replace("0", "o").replace("vv", "w")
    return _ascii_folded(name.replace("cl", "d") if builtin else name)

  def long(names):
    return [n for n in dict.fromkeys(names) if len(n) > 2 and n.isascii()]

  mine: dict[str, str] = {}
  for n in long(uses.defined):
    twin = mine.setdefault(read(n), n)
    if twin != n:
      return twin, n
  theirs = {read(n, True): n for n in dir(builtins) if len(n) > 2}
  for n in long(uses.called + uses.defined):
    twin = theirs.get(read(n, True), n)
    if twin != n:
      return twin, n
  bound = set(uses.bound) | set(bound)
  for n in long(uses.called + [n for n in uses.read if n not in bound]):
    twin = mine.get(read(n), n)
    if twin != n:
      return twin, n
  return None


def _ascii_twins(bound: list, strings: list) -> Optional[tuple[str, str]]:
  """Two ASCII names of three letters or more, one of them bound by code, that read
  alike (`_ascii_folded`), or None: `def is_Ieap` beside `def is_leap`, or a string
  `"is_prirne"` code makes a name of beside `def is_prime`. (A name only used, as the
  builtin `all` beside a matrix entry `a11`, is not compared.)"""
  folded = {}
  for n in dict.fromkeys(bound):
    if len(n) > 2 and n.isascii():
      twin = folded.setdefault(_ascii_folded(n), n)
      if twin != n:
        return twin, n
  for n in dict.fromkeys(strings):
    twin = folded.get(_ascii_folded(n), n) if len(n) > 2 else n
    if twin != n:
      return twin, n
  return None


# ASCII's own letters many fonts draw alike (beside rn and m), folded when ASCII names
# are compared (not i and l: code holds both as loop names).
_CODE_ALIKE = str.maketrans("I10", "llO")


def _ascii_folded(name: str) -> str:
  """An ASCII name with the letters many fonts draw alike folded (`is_Ieap` as
  `is_leap`, `is_prirne` as `is_prime`: red team 32)."""
  return name.translate(_CODE_ALIKE).replace("rn", "m")


class _Word(str):
  """A name found by the token scan of text that did not parse (prose's words, or a
  syntax newer than this host's): no name a string holds for code to bind."""


def _names(tree: ast.AST):
  for node in ast.walk(tree):
    for field in _NAME_FIELDS:
      value = getattr(node, field, None)
      for name in (value if isinstance(value, list) else [value]):
        if isinstance(name, str):
          yield name


# The most text the source checks read, every file's and what its strings hold as
# Python read again: a solution to these tasks is a few KiB. Unbounded, the checks'
# own time (about 5 s a MiB of short lines here) let a policy push a wrong answer's
# verify past the worker's deadline, an infrastructure error (a re-roll, never a
# penalty), with one tool call writing padding (red team 16).
MAX_CHECKED_CHARS = 1 << 18


class _TooMuchToCheck(Exception):
  pass


def _spend(budget: list, n: int) -> None:
  budget[0] -= n
  if budget[0] < 0:
    raise _TooMuchToCheck


def _bound(tree: ast.AST):
  """The names code binds: functions, classes, assignments' and loops' targets,
  arguments, imports."""
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      yield node.name
    elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
      yield node.id
    elif isinstance(node, ast.arg):
      yield node.arg
    elif isinstance(node, ast.alias):
      yield (node.asname or node.name).split(".")[0]


# Calls that take a function as their first argument (or `key=`): a name handed them
# is used as a callable.
_TAKES_A_FUNCTION = {"map", "filter", "reduce", "partial", "starmap", "filterfalse",
                     "takewhile", "dropwhile", "vectorize", "apply_along_axis",
                     "methodcaller", "cache", "lru_cache", "wraps", "singledispatch"}


@dataclasses.dataclass
class _Uses:
  """What code does with names (`_called_twin`): calls (or uses as callables), defines
  as callables, reads, and binds as names or attributes (`_bound` has the rest)."""
  called: list = dataclasses.field(default_factory=list)
  defined: list = dataclasses.field(default_factory=list)
  read: list = dataclasses.field(default_factory=list)
  bound: list = dataclasses.field(default_factory=list)

  def add(self, tree: ast.AST) -> None:
    def name_of(node):
      """The name a callable expression reads as (`f`, `x.f`, `x.f.__call__`, `a or f`)."""
      while True:
        if isinstance(node, ast.Attribute) and node.attr == "__call__":
          node = node.value
        elif isinstance(node, ast.BoolOp):
          node = node.values[-1]
        elif isinstance(node, ast.IfExp):
          node = node.body
        else:
          break
      return node.id if isinstance(node, ast.Name) else (
          node.attr if isinstance(node, ast.Attribute) else None)

    for node in ast.walk(tree):
      if isinstance(node, ast.Call):
        self.called.append(name_of(node.func))
        if name_of(node.func) in _TAKES_A_FUNCTION and node.args:
          self.called.append(name_of(node.args[0]))
        if name_of(node.func) == "accumulate" and len(node.args) > 1:  # (its function second)
          self.called.append(name_of(node.args[1]))
        self.called += [name_of(k.value) for k in node.keywords if k.arg in ("key", "func")]
        if (name_of(node.func) in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str) and node.args[1].value.isidentifier()):
          # (a name reached through a string: `getattr(builtins, "surn")(xs)`)
          self.called.append(node.args[1].value)
      elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        self.defined.append(node.name)
        self.called += [name_of(d.func if isinstance(d, ast.Call) else d)
                        for d in node.decorator_list]
      elif isinstance(node, ast.alias):
        self.defined.append((node.asname or node.name).split(".")[-1])
      elif isinstance(node, ast.arguments):  # (an argument whose default is a function)
        positional = node.posonlyargs + node.args
        pairs = list(zip(positional[len(positional) - len(node.defaults):], node.defaults))
        pairs += [(a, d) for a, d in zip(node.kwonlyargs, node.kw_defaults) if d is not None]
        self.defined += [a.arg for a, d in pairs
                         if isinstance(d, (ast.Name, ast.Attribute, ast.Lambda))]
      elif isinstance(node, ast.Name):
        (self.read if isinstance(node.ctx, ast.Load) else self.bound).append(node.id)
      elif isinstance(node, ast.Attribute):
        (self.read if isinstance(node.ctx, ast.Load) else self.bound).append(node.attr)
    self.called = [n for n in self.called if n is not None]


def _names_in(text: str, budget: list, depth: int = 0,
              bound: Optional[list] = None,
              uses: Optional[_Uses] = None) -> tuple[list[str], list[str]]:
  """(The names `text` uses as Python, the names its strings hold as Python). A string
  can name things (`globals()[...]`, `setattr`, `exec`): one that is not ASCII is read
  as Python in turn (indented too), four levels down, and one that is a name is one.
  Text that is not Python (a syntax newer than this host's, prose) gives its name
  tokens; a leading BOM is skipped, as Python does. The names code binds go to `bound`.
  Every text read is taken from `budget` ([characters left]; `_TooMuchToCheck` past
  it). What it does with its names goes to `uses` (`_Uses`)."""
  source = text[1:] if text.startswith("\ufeff") else text
  _spend(budget, len(source))
  try:
    tree = pyparse.parse(textwrap.dedent(source) if depth else source)
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    return _name_tokens(source), []
  own, held = list(_names(tree)), []
  if bound is not None:
    bound += _bound(tree)
  if uses is not None:
    uses.add(tree)
  for node in ast.walk(tree):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
      if node.value.isidentifier():
        held.append(node.value)
      elif depth < 4 and not node.value.isascii():
        inner = _names_in(node.value, budget, depth + 1, bound, uses)
        held += inner[0] + inner[1]
  return own, held


# Names in text that does not parse, in one pass (Python's own tokenize rescans a
# line's white space at each character it cannot read: a 16,000-character line took it
# a minute, a verify past the worker's deadline, an infrastructure error; reviewer).
# Comments, numbers and string literals are passed over, names kept; a quote that
# opens no string on its line (prose's apostrophe) is passed alone, as tokenize does,
# and what follows it is read (a name after it was missed: reviewer). A string that
# does not end from one quote ends from no later one of its kind before where that
# scan stopped (a later quote there was escaped), so nothing is scanned twice.
_TOKEN = re.compile(r"""
    (?P<comment>\#[^\n]*+)
  | (?P<number>\.?\d[\w.]*+)
  | (?P<quote>[rRbBuUfF]{0,2}(?:'''|\"\"\"|'|"))
  | (?P<name>[^\W\d]\w*+)
""", re.X)
# A string's body from after its opening quote: up to its closing quote (unescaped), or
# for a one-line string an unescaped line end, or the end of the text.
_STRING_BODY = {q: re.compile(body, re.S) for q, body in (
    ("'''", r"(?:[^'\\]++|\\(?:.|\Z)|'(?!''))*+"),
    ('"""', r'(?:[^"\\]++|\\(?:.|\Z)|"(?!""))*+'),
    ("'", r"(?:[^'\\\n]++|\\(?:.|\Z))*+"),
    ('"', r'(?:[^"\\\n]++|\\(?:.|\Z))*+'))}


def _name_tokens(text: str) -> list[str]:
  """The names of text that does not parse (its comments, numbers and strings passed
  over), in time linear in its length."""
  names, pos = [], 0
  open_until = {}  # quote: where a string it opened stopped unended (none ends before)
  while True:
    m = _TOKEN.search(text, pos)
    if m is None:
      return names
    pos = m.end()
    if m.lastgroup == "name":  # (and the marks a name holds, which \w does not take)
      while pos < len(text) and ("a" + text[pos]).isidentifier():
        pos += 1
      names.append(_Word(text[m.start():pos]))
    elif m.lastgroup == "quote":
      quote = m.group().lstrip("rRbBuUfF")
      if m.start() < open_until.get(quote, -1):
        pos = m.start() + len(m.group()) - len(quote) + 1  # (a stray quote)
        continue
      stop = _STRING_BODY[quote].match(text, pos).end()  # (one scan: ended or not)
      if text.startswith(quote, stop):
        pos = stop + len(quote)
      else:
        open_until[quote] = stop
        pos = m.start() + len(m.group()) - len(quote) + 1


def _misread_name(files: dict[str, str]) -> Optional[str]:
  """Why a name in these files would be read as another, or None. What a judge reads
  must be what runs: a name that is not ASCII can look like another while Python keeps
  them apart (`is_prime` with an invisible Hangul filler after it, kept by NFKC, or
  with a Cyrillic `і`, defines a second function that reads to a judge like a general
  version of the first, hard-coded one the tests call). A `.py` file's own names must
  be ASCII. What its strings hold as Python, and other files (a loader may run them,
  or a slice of them), may use names of any script, but not one that reads as another
  name of these files, a builtin or a keyword, nor two spellings that read as one name
  (`сheck` with a Cyrillic с and `chеck` with a Cyrillic е, where no plain `check` is
  written: red team 31): read with their marks, or without where that reads as ASCII
  (an invisible mark on a look-alike). Prose is not refused for its words (a Cyrillic
  о and a Greek ο, one letter each of text that is not Python, are prose's; an Arabic
  word with and without its vowel marks reads as two). Two ASCII names, one bound by
  code, that read alike (`is_Ieap`, `is_leap`) are refused. A name code makes at run
  time from any text (a comment read back, a string padded with an invisible character,
  `"sum_digit" + "ѕ"`) is no reading of the text's: the harness reads the names of the
  modules the solution imports, once it is imported and after its last case
  (`envs.verifier`, red team 32)."""
  ascii_names = set(dir(builtins)) | set(keyword.kwlist)
  elsewhere, budget = [], [MAX_CHECKED_CHARS]
  bound: list[str] = []  # the names code binds (def, class, assignment, import, argument)
  strings: list[str] = []  # the ASCII names strings hold (`globals()["is_Ieap"]`)
  uses = _Uses()  # what code does with its names (calls, defines, reads, binds)
  for name, text in files.items():
    own, held = _names_in(text, budget, bound=bound, uses=uses)
    strings += [n for n in held if n.isascii() and not isinstance(n, _Word)]
    if name.endswith(".py"):
      odd = next((n for n in own if not n.isascii()), None)
      if odd is not None:
        return (f"{name}: the name {ascii(odd)} is not ASCII (a name may look like another "
                "that Python keeps apart); write names in ASCII")
    else:
      own, held = [], own + held
    ascii_names.update(n for n in own + held if n.isascii())
    elsewhere += [(name, n) for n in dict.fromkeys(held) if not n.isascii()]
  ascii_twins = _ascii_twins(bound, strings)
  if ascii_twins:
    return (f"the names {ascii_twins[0]!r} and {ascii_twins[1]!r} read alike (I, 1 and l; "
            "0 and O; rn and m: a look-alike a judge would take for the other); name "
            "them apart")
  called_twin = _called_twin(uses, bound)
  if called_twin:
    return (f"the code uses {called_twin[1]!r} as a callable, which reads as "
            f"{called_twin[0]!r} (I, 1 and l; 0 and O or o; rn and m; vv and w; beside a "
            "builtin, cl and d: a look-alike a judge would take for the other, whatever "
            "it was bound to); name them apart")
  by_reading = {n.translate(_ALIKE): n for n in ascii_names}
  twins: dict[str, str] = {}  # a reading (folded) -> the first spelling read so
  for name, odd in elsewhere:
    seen = _as_read(odd)
    # (one letter is prose's, or a Greek label's: `"ν"` beside a name `v`; a one-letter
    # name code binds is read at run time, `envs.verifier`)
    plain = None if len(seen) == 1 else by_reading.get(seen.translate(_ALIKE))
    if plain is not None:
      return (f"{name}: the name {ascii(odd)} reads as {plain!r}, another name (a look-alike "
              "a judge would take for it); write names in ASCII")
    for reading in {_as_read(odd, marks=True), *([seen] if seen.isascii() else [])}:
      if len(reading) == 1:
        continue
      twin = twins.setdefault(reading.translate(_ALIKE), odd)
      if twin != odd:
        return (f"{name}: the names {ascii(twin)} and {ascii(odd)} both read as "
                f"{reading!r} (look-alikes a judge would take for one name); write names "
                "in ASCII")
  return None


# Compiled code Python would import in place of a source file: bytecode, extension
# modules (every platform's suffixes, not only this host's).
_COMPILED = (".pyc", ".pyo", ".so", ".pyd", ".dll", ".dylib")
_CODING = re.compile(rb"^[ \t\f]*#.*?coding[:=][ \t]*([-\w.]+)")


# Unicode's bidirectional controls: text that reads differently from how it runs
# ("Trojan Source").
_BIDI = re.compile("[\u202a-\u202e\u2066-\u2069]")
# Control characters but tab and the line ends: a form feed in a line's indentation
# resets Python's count of it, so a line shown nested under a `def` or an `if False:`
# runs at module level (red team, stop 41); the others have no place in source either.
# The line and paragraph separators (U+2028, U+2029) end a line for a reader (a judge,
# `str.splitlines`), not for Python: code after one in a comment reads as a live line
# that never runs (red team, stop 52).
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u2028\u2029]")


# The source checks run one at a time, in arrival order, on a thread of their own. Run
# side by side (each on a thread of the default pool) they took turns parse by parse
# under the parser's process-wide lock and the GIL, so each took as long as all of
# them: eight padded wrong answers and a correct one verified at once all passed a 6 s
# worker deadline (infrastructure errors; the wrong answers re-rolled, red team 22).
# The wait for the thread is the infrastructure's, not the episode's.
_CHECKS = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxagent-source-check")


async def checked(fn, *args):
  """`fn(*args)` on the source-check thread; the time it waits for the thread (behind
  other episodes' checks) is marked as a wait on shared infrastructure."""
  loop = asyncio.get_running_loop()
  started = asyncio.Event()

  def job():
    loop.call_soon_threadsafe(started.set)
    return fn(*args)

  done = asyncio.wrap_future(_CHECKS.submit(job))
  begun = asyncio.ensure_future(started.wait())
  try:
    # (a queue that moves, each check bounded by its text's: the worker's wall counted
    # it, and verifies padded to slow checks queued past it, 504s re-rolled: red team 35)
    with waits.waiting(), waits.queued():
      await asyncio.wait([done, begun], return_when=asyncio.FIRST_COMPLETED)
    return await done
  except asyncio.CancelledError:
    done.cancel()  # (a check not yet started never runs)
    raise
  finally:
    begun.cancel()


def source_problem(files: dict[str, bytes], module: str = "solution") -> Optional[str]:
  """Why these files cannot be graded as written, or None. What the judge reads must
  be what Python runs: every graded file must be UTF-8 text under a printable UTF-8
  name (a newline in a name could forge a file header in the judge's view), with no
  bidirectional controls or other control characters (but tab and line ends), no file may hold characters a name would read as others
  (NFKC; in strings and comments too, where an `exec` or a loader finds them), file
  names must be ASCII, no name may read as another (`_misread_name`), and no file may
  declare another source encoding (PEP 263: Python would run what a `# coding: utf-7`
  line decodes, and a loader can run any file as source, while the judge sees the raw
  text, so a hard-coded answer could hide in a comment). `module` must not be both a
  package and a module (the package is what Python imports). The files hold at most
  `MAX_CHECKED_CHARS` of text to check, their strings read as Python counted again."""
  texts, checked = {}, 0
  too_much = (f"the files hold more than {MAX_CHECKED_CHARS} characters to check (what "
              "their strings hold as Python counted again): a solution here is graded "
              "from at most that")
  for name, data in files.items():
    try:
      name.encode("utf-8")
    except UnicodeEncodeError:
      return f"file name {name.encode('utf-8', 'backslashreplace')!r} is not UTF-8"
    if not name.isprintable():
      return f"file name {name!r} holds control characters"
    if not name.isascii():  # (a module's file named like another: `import_module`)
      return f"file name {ascii(name)} is not ASCII; name files in ASCII"
    try:
      text = texts[name] = data.decode("utf-8")
    except UnicodeDecodeError:
      return f"{name} is not UTF-8 text"
    checked += len(text)
    if checked > MAX_CHECKED_CHARS:
      return too_much
    if _BIDI.search(text):
      return f"{name} holds Unicode bidirectional controls"
    control = _CONTROL.search(text)
    if control:
      line = text.count("\n", 0, control.start()) + 1
      return (f"{name} line {line} holds the control character {control.group()!r} "
              "(only tab, newline and carriage return are allowed)")
    odd = _unnormalized_char(text)  # in any file: a loader can run any file as source
    if odd is not None:
      return (f"{name}: {odd!r} (U+{ord(odd):04X}) reads in a Python name as "
              f"{unicodedata.normalize('NFKC', odd)!r}; write that")
    for line in data.splitlines()[:2]:
      m = _CODING.match(line)
      if m and m.group(1).lower().replace(b"_", b"-") not in (b"utf-8", b"utf8"):
        return f"{name} declares the source encoding {m.group(1).decode()!r} (only UTF-8)"
  if f"{module}.py" in files and f"{module}/__init__.py" in files:
    return f"{module} is both a module and a package"
  try:
    return _misread_name(texts)
  except _TooMuchToCheck:
    return too_much


def _output(result) -> str:
  """A command's outcome as the tool's answer. A command the sandbox could not run (no
  execution slot in time, could not start) is the infrastructure's failure: it ends the
  episode as such (dropped, never scored), and the policy never sees it as its output."""
  if result.error is not None:
    raise InfraError("sandbox", result.error)
  out = {"exit_code": result.exit_code, "timed_out": result.timed_out,
         "stdout": result.stdout[-2000:], "stderr": result.stderr[-2000:]}
  return json.dumps(out)


@register("python_tests")
class PythonTests(Env):
  # 2: hidden cases compared on the host; the verdict pays the reward. 3: files must be
  # UTF-8 text, fit the quota as read, and (with a judge) be shown whole.
  # 4: look-alike names refused; the judge's file headers are tagged. 5: stronger hidden
  # cases (each task's hold its public example); max_of_list may use max(). 6: no name
  # reads as another (a .py file's own are ASCII; look-alikes in strings, other files).
  # 7: the files fail past MAX_CHECKED_CHARS of text to check. 8: stronger hidden cases
  # (seven wrong solutions passed); control characters refused (a form feed in the
  # indentation ran code shown as nested). 9: stronger hidden cases (a red team's 32 wrong
  # solutions passed: float arithmetic on big integers, ASCII-only text, Julian leap
  # years); five descriptions say what the cases already held (ASCII letters, spaces).
  # 10: stronger hidden cases (26 more wrong solutions: a dedupe that looks back a few
  # elements, trial division by small primes only or too few Fermat / Miller-Rabin bases,
  # whitespace of three kinds, the first letter for the first character, regular
  # expressions' case folding and `.`, a shift wrapped once); count_vowels' reference
  # counts ASCII vowels only ('İ'.lower() holds an 'i'); are_anagrams says tabs count.
  # 11: stronger hidden cases (28 more wrong solutions: whole strings lower-cased or
  # case-folded, white space of ASCII or four kinds only, negative and Miller-Rabin
  # primes, Roman digits by digit, leap years past the Gregorian, exact formulas at too
  # little precision); are_anagrams' reference lower-cases a character at a time (ΑΣ and
  # ΣΑ are anagrams); word_count and are_anagrams say which white space and folding.
  # 12: stronger hidden cases (21 more wrong solutions: precomputed sieves and capped
  # trial division, sentinel starts, sentinels the text may hold, negative shifts past a
  # wrap, title case for upper case, palindromes keeping '_' or symbols, a rounded exact
  # conversion, a dropped newline, floats through range(), a look-back of 9).
  # 13: two non-ASCII spellings that read as one ASCII name are refused. 14: an own
  # task's default public test checks type and value as the grader does, of its first
  # case whose check is short. 15: a name the code uses as a callable that reads as
  # another callable (one the files define, or a builtin's: `surn(` as `sum`) is refused.
  # 16: a name getattr, setattr, hasattr or delattr is handed as a string is one used
  # as a callable (`getattr(builtins, "surn")`).
  version = "16"
  verifier_version = PythonTestVerifier.version
  needs_resources = True
  asks_judge = True

  def __init__(self, resources: EnvResources):
    super().__init__()
    self.resources = resources
    self.verifier = PythonTestVerifier(resources.pool())
    self._lease = None
    self.sandbox = None
    self.tools = ToolSet([
        Tool("write_file", "Write a text file in the workspace",
             {"type": "object", "properties": {"path": {"type": "string",
                                                        "maxLength": MAX_PATH_CHARS},
                                               "content": {"type": "string"}},
              "required": ["path", "content"], "additionalProperties": False},
             self._write_file),
        Tool("run_python", "Run Python code in the workspace; returns exit code and output",
             {"type": "object", "properties": {"code": {"type": "string"}},
              "required": ["code"], "additionalProperties": False}, self._run_python),
        Tool("run_public_tests", "Run the public tests against solution.py",
             {"type": "object", "properties": {}, "additionalProperties": False},
             self._run_public_tests),
    ])

  async def _write_file(self, path: str, content: str) -> str:
    if os.path.normpath(path) in (PUBLIC_TESTS, GRADING):  # (./test_public.py too)
      return f"error: {echoed(path)} is read-only"
    data = content.encode()
    await asyncio.to_thread(self.sandbox.write_file, path, data)
    return f"wrote {len(data)} bytes to {echoed(path)}"

  async def _run_python(self, code: str) -> str:
    await asyncio.to_thread(self.sandbox.write_file, "_run.py", code)
    return _output(await self.sandbox.run([self.sandbox.python, "_run.py"]))

  def _write_public_tests(self) -> None:
    check = checker_name(self.fn)
    own = "task" not in self.task.params
    self.sandbox.write_file(PUBLIC_TESTS, (
        f"from _grading import graded_equal as {check}\n" if own else "")
        + as_tests(self.spec[3], "public", self.fn))
    if own:  # (its graded_equal, which the default public test asks)
      self.sandbox.write_file(GRADING, grading_module())

  async def _run_public_tests(self) -> str:
    # The task's own public test, written again: tool code may have replaced the file.
    await asyncio.to_thread(self._write_public_tests)
    # (the test functions the module defines, not the solution's function it imports,
    # whose name may start with test_ too)
    runner = ("import traceback\nimport test_public as t\nok = True\n"
              "for n in sorted(dir(t)):\n  f = getattr(t, n)\n"
              "  if n.startswith('test_') and getattr(f, '__module__', '') == t.__name__:\n"
              "    try:\n"
              "      getattr(t, n)(); print(n, 'passed')\n    except Exception as e:\n"
              "      ok = False; print(n, 'FAILED', type(e).__name__, e)\n"
              "raise SystemExit(0 if ok else 1)\n")
    return _output(await self.sandbox.run_python(runner, filename="_public_runner.py"))

  async def reset(self, task: TaskSpec) -> Observation:
    spec, fn = task_spec(task)
    await self.close()
    self.task = task
    self.spec, self.fn = spec, fn
    self.max_turns = task_int(task.params, "max_turns", 8, task.id)
    self.turns, self.done, self._ref_step = 0, False, 0
    self.reset_counters()
    self._lease = self.resources.pool().acquire()
    self.sandbox = await self._lease.__aenter__()
    self._write_public_tests()
    user = self.spec[1] + (f"\nPublic test:\n{self.spec[3]}" if self.spec[3].strip() else "")
    if "task" not in task.params and "public_test" not in task.params and self.spec[3]:
      user += (f"\n({checker_name(fn)}: equal as the hidden tests compare, in type and "
               "value, floats within 1e-9)")
    return Observation([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
                       self.tools.schemas())

  async def step(self, action: str) -> StepResult:
    run = await self.tools.run_turn(self, action)
    terminated = not run.messages
    truncated = not terminated and self.turns >= self.max_turns
    self.done = terminated or truncated
    info = self._info(tool_latency_s=run.latencies_s)
    if truncated:
      info["truncation"] = "turn_budget"
    return StepResult(Observation(run.messages), 0.0, terminated, truncated, info)

  def final_files(self) -> dict[str, bytes]:
    """The files graded (and shown to a judge): the workspace's, without our own and
    without compiled code, so what runs is the source that was written: an
    unchecked-hash .pyc in __pycache__, or an extension module
    (`solution.cpython-311-x86_64-linux-gnu.so`, which the sandbox's gcc can build and
    which Python imports before `solution.py`), would otherwise run in place of an
    innocent-looking solution.py."""
    skip = {PUBLIC_TESTS, GRADING, "_run.py", "_public_runner.py"}
    return {k: v for k, v in self.sandbox.files().items()
            if k not in skip and not k.endswith(_COMPILED) and "__pycache__" not in k.split("/")}

  def _left_out(self, name: str) -> Optional[str]:
    """Why the workspace's `name` is not among the files graded, when it is there (a
    reviewer: graded as "did not load: ModuleNotFoundError", which named no cause)."""
    try:
      st = os.lstat(os.path.join(self.sandbox.host_path, name))
    except (FileNotFoundError, NotADirectoryError):  # (not written)
      return None
    except OSError as e:  # (the host's: the workspace gone, an I/O error)
      raise InfraError("sandbox", f"looking for {name} in the workspace: {e}") from e
    if stat.S_ISLNK(st.st_mode):
      return (f"{name} is a symbolic link: only the workspace's regular files are "
              "graded")
    if not stat.S_ISREG(st.st_mode):
      return f"{name} is not a regular file: only those are graded"
    if st.st_size > self.sandbox.limits.write_bytes:
      return (f"{name} holds {st.st_size} bytes, over the {self.sandbox.limits.write_bytes} "
              "a graded file may hold")
    try:
      with open(os.path.join(self.sandbox.host_path, name), "rb"):
        pass
    except OSError as e:  # (its mode shuts the reader out)
      return f"{name} could not be read to be graded ({type(e).__name__})"
    return (f"{name} was not among the files graded: the workspace holds more than are "
            "copied to grade (256, in name order)")

  async def verify(self) -> Verdict:
    if self.sandbox is None:
      raise RuntimeError("verify() needs an episode: reset first")
    env_version = f"{self.name}@{self.version}"
    try:
      files = await asyncio.to_thread(self.final_files)
      # (off the event loop, as every read of the files: a workspace of megabytes of
      # text held every other episode on this worker for a second)
      problem = await checked(source_problem, files)
    except WorkspaceTooLarge as e:  # the policy's doing: its files will not fit to grade
      problem = str(e)
    tests = HiddenTests(self.fn, self.spec[4])
    if problem is None and f"{tests.module}.py" not in files:
      problem = await asyncio.to_thread(self._left_out, f"{tests.module}.py")
    if problem is not None:
      return Verdict(VerdictStatus.FAIL, 0.0, env_version, self.verifier_version,
                     {"reason": problem})
    verdict = await self.verifier.grade(files, tests, env_version=env_version)
    if self.resources.judge is not None:  # a pass is shown to the judge too (ROLL)
      # The judge's time is a wait on shared infrastructure (a served model, queued
      # behind the run's rollouts): not charged to the episode's or the worker call's
      # deadline (a slow judge after a slow grading run turned a hard-coded answer's
      # FAIL into a worker deadline, an infrastructure error, a re-roll: red team). It
      # is bounded by the judge's own timeout and retries, not by the worker call's wall
      # (counted there, a judge's first try timing out and its second failing a
      # hard-coded table passed a 120 s wall: a 504, re-rolled; a reviewer).
      answer = await asyncio.to_thread(judged_answer, files)  # (the episode's own time)
      with waits.waiting(), waits.queued():
        verdict = await self.resources.judge.confirm(verdict, self.spec[1], answer)
    return verdict

  async def close(self) -> None:
    if self._lease is not None:
      lease, self._lease, self.sandbox = self._lease, None, None
      await lease.__aexit__(None, None, None)

  def shortcuts(self) -> dict[str, list[str]]:
    """An own task's answers that know nothing (None, the first argument back, each of
    its first distinct expected values as a constant); a bundled task's cases are kept
    failing near misses by the tests (`tests/envs/test_python_tasks.py`)."""
    if "task" in self.task.params:
      return {}
    cases = self.spec[4]
    answers = {"returns None": "None"}
    if all(args for args, _ in cases):
      answers["returns its first argument"] = "args[0]"
    seen = set()
    for _, expected in cases:
      key = json.dumps(values.encode(expected))
      if key not in seen and len(seen) < 3:
        seen.add(key)
        said = _literal(expected)
        said = said if len(said) <= 40 else said[:37] + "..."
        label = f"returns {said} for every case"  # (two alike at first: told apart)
        answers[label if label not in answers else f"{label} ({len(seen)})"] = \
            _literal(expected)
    write = {"name": "write_file", "arguments": {"path": "solution.py", "content": ""}}
    out = {}
    for what, answer in answers.items():
      write["arguments"]["content"] = f"def {self.fn}(*args, **kwargs):\n    return {answer}\n"
      out[what] = [f"<tool_call>{json.dumps(write)}</tool_call>", "DONE"]
    return out

  def reference_action(self) -> str:
    if not self.spec[2]:
      raise NotImplementedError(f"task {self.task.id} gives no reference solution "
                                "(params.reference)")
    self._ref_step += 1
    if self._ref_step == 1:
      call = {"name": "write_file", "arguments": {"path": "solution.py", "content": self.spec[2]}}
      return f"<tool_call>{json.dumps(call)}</tool_call>"
    return "DONE"


def make_tasks() -> list[TaskSpec]:
  return [TaskSpec(f"python_tests/{t[0]}", "python_tests", {"task": t[0]}) for t in TASKS]
