"""Grading in a clean workspace, by a harness the solution cannot steer.

The agent's final files are copied into a fresh sandbox workspace. The hidden
cases, `(args, expected)`, are split: only the arguments enter the sandbox (on
the harness's stdin); the expected values stay on the host. In the sandbox:

- the harness starts as `python3 -I -B -c HARNESS` (no bytecode written: `-I` drops
  PYTHONDONTWRITEBYTECODE, and a data module's `.pyc`, 2.5x its source, put a correct
  solution past a workspace's bounds without a quota): no user site, no `.pth` or
  `*customize.py` from the workspace, no `PYTHON*` variables, and nothing of the
  workspace on `sys.path` while it imports what it needs;
- it is the init of the sandbox's PID namespace (so nothing it starts can kill
  or signal it), ignores SIGINT, and is not dumpable (nothing can ptrace it or
  open its file descriptors through /proc);
- it forks the solution's process, which closes the report channel, sends its
  prints to stderr, puts the workspace first on `sys.path`, as the episode's tools
  ran it (a helper `code.py` the solution imports is its own, not the standard
  library's; of the modules the harness imported, those the workspace holds one of the
  same name of are forgotten first), imports the solution, sends back the names the
  modules it imported then hold that are not ASCII identifiers (a name made at run
  time from a string reads to a judge as the name it looks like: a fail),
  calls the function on each case's arguments and sends back each return value
  encoded by exact type (`envs.values`: an object with a forged `__eq__` is not
  a value), then those names again (a module imported in a call);
- the harness reads at most `max_report_bytes` of results, waits for the
  solution's process, and writes one report on its stdout, the channel only it
  holds.

The host decodes the returned values and compares them with the expected ones
by type and value. Forging a report gains nothing: a report passes only if it
carries the right return values.

Verdicts:
- `pass`: every case returned the expected value;
- `fail`: a wrong answer, a solution that crashes, exits early, runs out of
  memory or returns something that is not plain data;
- `timeout`: the solution ran past the time limit (wall clock, or the CPU limit,
  which the sandbox keeps above the wall limit);
- `infra_error`: the grader itself failed (the sandbox would not start, the
  harness never started, or it died after starting without a report: it cannot
  be killed from inside). The learner drops or retries such samples instead of
  scoring them 0. Grading is a pure function of (files, cases), so retries are
  idempotent; infra errors are retried here up to `retries` times first.

Without namespaces (`rlimits`, allowed only explicitly) the harness is not an
init and the solution could kill it: that ends as `infra_error`, never `pass`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import inspect
import json
import threading
from typing import Any, Optional, Sequence

from envs import values, waits
from envs.base import Verdict, VerdictStatus
from envs.isolation import seccomp_keep_dumpable
from envs.pool import SandboxPool
from envs.sandbox import ExecResult, Sandbox

# 3: the report is capped to what the host keeps; 4: values nested past what the host
# reads are errors, the solution is the kernel's first pick when memory runs out; 5: the
# solution's process lets go of the harness's report before it turns dumpable; dict keys
# compare exactly; 6: the workspace first on the solution's `sys.path`; 7: a grading
# workspace without a quota that the solution fills past its bounds is a fail; no
# bytecode is written. 8: a dict subclass (a Counter) grades as the dict it holds. 9: the
# solution's process stays dumpable (a non-root worker's disk watch sees its files). 10:
# the solution's prctl(PR_SET_DUMPABLE, 0) does nothing (ssh-agent in its tests). 11: the
# modules the harness imported that the workspace holds one of the same name of are the
# workspace's for the solution. 12: the names of the modules the solution makes are
# read once it is imported and after its last case: one that is not an ASCII identifier,
# or two that read alike, are a fail. 13: the report holds as much as the harness reads
# of results (it was cut at the commands' 16 KiB: a correct answer of 600 cases failed).
# 14: the names of the classes the solution makes, and the names it adds to modules there
# were (builtins), are read too.
VERSION = "python-harness-14"

_HARNESS_BODY = r'''
import builtins, ctypes, gc, importlib, importlib.machinery, os, select, signal, sys

signal.signal(signal.SIGINT, signal.SIG_DFL)  # as init, a default disposition is immune
try:  # PR_SET_DUMPABLE = 4: no ptrace of this process, no /proc/<pid>/fd or mem for others
  ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
except Exception:
  pass
report = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
spec = json.loads(sys.stdin.read())
if spec.get("seccomp"):  # for the solution: prctl(PR_SET_DUMPABLE, 0) does nothing
  class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
  _bpf = bytes.fromhex(spec["seccomp"])
  _buf = ctypes.create_string_buffer(_bpf, len(_bpf))
  _program = _Program(len(_bpf) // 8, ctypes.cast(_buf, ctypes.c_void_p))
  ctypes.CDLL(None).prctl(38, 1, 0, 0, 0)  # (no_new_privs: bwrap set it already)
  ctypes.CDLL(None).prctl(22, 2, ctypes.byref(_program), 0, 0)  # (best effort)
report.write("START\n")
report.flush()


def odd_names(before, classes_before, at_end, solution, modules=sys.modules,
              module_type=type(sys), module_dict=type(sys).__dict__["__dict__"].__get__,
              class_dict=type.__dict__["__dict__"].__get__, builtins_dict=vars(builtins),
              function_type=type(lambda: 0), objects=gc.get_objects, type=type, id=id,
              issubclass=issubclass, callable=callable, list=list, len=len, set=set,
              dict=dict, str=str,
              ascii=ascii, dumps=json.dumps, fold=str.maketrans("I10", "llO")):
  """The names that the modules made since `before` (their dicts there were, by id,
  each with the names it held) hold that are not ASCII identifiers, or that read alike
  in ASCII (I, 1 and l; 0 and O; rn and m), and the `solution` module put out of its
  place, as one report line: a name made from strings at run time
  (`globals()["sum_digit" + "\u0455"]`, a Cyrillic letter; `"su" + "rn_digits"`) reads
  to a judge as the name it looks like. Read once the solution is imported and again
  after its last case (a module it imports in a call). Every module object there is,
  in `sys.modules` or not, and every dict a function's globals are (a module taken out
  of `sys.modules` lives on in its functions), whatever their class or `__file__`, its
  names read beside the builtins' (every module reads them: `Iist` reads as `list`);
  the names added to a module or a class there was before, read beside the names it
  held (`setattr(builtins, "I" + "en", ...)` reads as `len`; a reviewer); and every
  class made since (`classes_before`, by id, each with the names it held:
  `setattr(K, "he" + "Iper", ...)` was read by none; a reviewer), whose dicts may hold
  names no code spells (an extension's). A module or class is known by its type, not
  its `__class__` (a proxy of one is neither). What it calls is bound here, before the
  solution can rebind a builtin, `json.dumps` or `gc`."""
  odd, seen = [], set()

  def spelt(k, own_name):
    """What `k` reads as (`own_name`: a class's key, read as the name its letters,
    digits and underscores spell), folded; None when it is too short to read alike."""
    if own_name:
      k = "".join([c for c in k if c.isalnum() or c == "_"])
    return k.translate(fold).replace("rn", "m") if len(k) > 2 else None

  def seeded(names, own_name=False):
    """The fold table of names there were (each one's own reading)."""
    table = {}
    for k in names:
      if type(k) is str and k.isascii():
        folded = spelt(k, own_name)
        if folded is not None:
          table.setdefault(folded, k)
    return table

  def look(keys, folded, own_name):
    """Adds the odd ones of `keys`, each read beside the names of `folded` (its fold
    table, which it joins)."""
    for k in keys:
      if type(k) is not str or not (k.isascii() or own_name and k.isidentifier()) or not (
          own_name or k.isidentifier()):
        odd.append(ascii(k)[:80])
        continue
      if not k.isascii():  # (a class's name in another script: pyparsing's `中文`; code
        continue  # that spells it is the source checks', a string that makes it shows)
      reads = spelt(k, own_name)
      if reads is not None:
        twin = folded.setdefault(reads, k)
        if twin != k:
          odd.append(twin + " ~ " + k)

  def added(names, old):
    return [k for k in list(names) if type(k) is not str or k not in old]

  try:
    if solution in modules and not issubclass(type(modules[solution]), module_type):
      odd.append(ascii(solution)[:80] + " is no module")
    # The builtins' names, those the solution added read beside those there were.
    old = before.get(id(builtins_dict), set())
    shared = seeded(old)
    look(added(builtins_dict, old), shared, False)
    seen.add(id(builtins_dict))  # (read: once)
    for obj in objects():
      kind = type(obj)
      if issubclass(kind, module_type):
        names, at, own_name, held = module_dict(obj), None, False, before
      elif kind is function_type:
        names, at, own_name, held = obj.__globals__, None, False, before
      elif issubclass(kind, type):
        names, at, own_name, held = class_dict(obj), id(obj), True, classes_before
      else:
        continue
      at = id(names) if at is None else at  # (a class's dict: a fresh proxy each time)
      if at in seen:
        continue
      seen.add(at)
      if at in held:  # (one there was: the names added since, beside its own)
        new = added(names, held[at])
        if new:
          look(new, seeded(held[at], own_name), own_name)
      elif own_name:  # (a class made since: its names, beside each other)
        look(list(names), {}, True)
      else:  # (a module: its names beside each other, and its callables beside the
        # builtins': a matrix entry `a11` is no look-alike of `all`; its reviewer)
        own = list(names)
        look(own, {}, False)
        look([k for k in own if type(k) is str and k.isascii() and k.isidentifier()
              and callable(names[k])], dict(shared), False)
  except Exception as e:  # (the solution's doing: its names cannot be read)
    odd.append("unreadable: " + type(e).__name__)
  return dumps({"odd_names": odd[:20], "at_end": at_end})


r, w = os.pipe()
pid = os.fork()
if pid == 0:  # the solution's process
  try:
    os.close(r)
    report.close()
    os.closerange(3, w)
    os.closerange(w + 1, 1 << 16)
    try:  # the kernel's first pick when the sandbox's memory runs out, not the harness
      # (asked, not enforced: the solution may write 0 back; the harness's OOM death in
      # the sandbox is the solution's failure either way)
      # (a process that is not dumpable cannot write its own /proc files. It stays
      # dumpable, holding no descriptor of the harness's but its result pipe: a worker
      # that is not root then reads the files it holds open or mapped, which filled the
      # host's disk unseen, and one of its processes that is not dumpable stops the
      # grading: `Sandbox.run`'s trusted_init)
      ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)
      with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    except Exception:
      pass
    sys.stdin = open(os.devnull)
    channel = os.fdopen(w, "w")
    sys.path.insert(0, os.getcwd())  # (first, as a tool's `python` and pytest have it;
    # nothing is imported after it but the solution: a helper `importlib.py` is its own)
    # What the harness imported that a fresh interpreter had not (json, signal, ctypes,
    # ...) is forgotten where the workspace holds a module of that name: the solution
    # imports its own, as the episode's `python` did (a helper `signal.py` passed the
    # public tests and failed the grading: red team 29). The harness keeps the modules
    # it holds.
    for top in {m.partition(".")[0] for m in sys.modules if m not in _STARTUP}:
      try:
        found = importlib.machinery.PathFinder.find_spec(top, [os.getcwd()])
      except Exception:
        found = None
      if found is not None and found.loader is not None:  # (not a namespace portion)
        for m in [m for m in sys.modules
                  if (m == top or m.startswith(top + ".")) and m not in _STARTUP]:
          del sys.modules[m]
    before_modules = list(sys.modules.values())  # (held: their ids stay theirs)
    before = {id(vars(m)): set(vars(m)) for m in before_modules if hasattr(m, "__dict__")}
    before_classes = [c for c in gc.get_objects() if issubclass(type(c), type)]  # (held too)
    classes_before = {id(c): set(type.__dict__["__dict__"].__get__(c)) for c in before_classes}
    try:
      fn = getattr(importlib.import_module(spec["module"]), spec["function"])
    except BaseException as e:
      channel.write(json.dumps({"import_error": (type(e).__name__ + ": " + str(e))[:300]}) + "\n")
      channel.flush()
      os._exit(0)
    # (a line of its own whatever the solution wrote before it)
    channel.write("\n" + odd_names(before, classes_before, False, spec["module"]) + "\n")
    channel.flush()
    for i, args in enumerate(spec["args"]):
      try:
        line = json.dumps({"i": i, "value": encode(fn(*decode(args)))})
      except BaseException as e:
        try:
          line = json.dumps({"i": i, "error": (type(e).__name__ + ": " + str(e))[:300]})
        except BaseException:
          line = json.dumps({"i": i, "error": "unprintable exception"})
      channel.write(line + "\n")
      channel.flush()
    channel.write("\n" + odd_names(before, classes_before, True, spec["module"]) + "\n")
    channel.flush()
  finally:
    os._exit(0)
os.close(w)
limit = spec["max_report_bytes"]
data, status, overflow = b"", None, False
while status is None:
  ready, _, _ = select.select([r], [], [], 0.05)
  if ready:
    chunk = os.read(r, 1 << 16)
    if chunk:
      data += chunk
      if len(data) > limit:
        overflow = True
        os.kill(pid, signal.SIGKILL)
  done, st = os.waitpid(pid, os.WNOHANG)
  if done:
    status = st
os.set_blocking(r, False)
try:  # what the solution's process wrote before it ended; nothing after
  while len(data) <= limit:
    chunk = os.read(r, 1 << 16)
    if not chunk:
      break
    data += chunk
except BlockingIOError:
  pass
results, import_error, odd, read_names = {}, None, [], set()
for line in data[:limit].split(b"\n"):
  try:
    item = json.loads(line)
  except Exception:  # not JSON, or nested past the recursion limit: not a result
    continue
  if not isinstance(item, dict):
    continue
  if isinstance(item.get("odd_names"), list):  # (every line's: a forged empty one adds none)
    read_names.add("at_end" if item.get("at_end") is True else "imported")
    try:
      odd += [str(x)[:100] for x in item["odd_names"][:20]]
    except Exception:  # (a forged entry str() cannot print: nested deep; a fail, as any)
      odd.append("unreadable")
  if import_error is None and isinstance(item.get("import_error"), str):
    import_error = item["import_error"][:300]
  i = item.get("i")
  if type(i) is int and 0 <= i < len(spec["args"]) and str(i) not in results:
    if "value" in item and json_depth(item["value"]) > MAX_JSON_DEPTH:
      # (parsed here, near the stack's bottom, it might not parse on the host's side)
      results[str(i)] = {"error": "value nested too deeply"}
    elif "value" in item:
      results[str(i)] = {"value": item["value"]}
    elif isinstance(item.get("error"), str):
      results[str(i)] = {"error": item["error"][:300]}
child = ({"exit": os.waitstatus_to_exitcode(status)} if os.WIFEXITED(status)
         else {"signal": os.WTERMSIG(status)})
try:
  line = json.dumps({"results": results, "import_error": import_error, "child": child,
                     "overflow": overflow, "odd_names": odd[:20],
                     "read_names": sorted(read_names)})
except Exception:  # a value nested too deep to encode again
  line = None
if line is None or len(line) > spec["max_report_line"]:
  # The host keeps only so much of this channel: a report that would not fit is an
  # overflow (a failure), never a report cut short (which would read as a dead harness).
  line = json.dumps({"results": {}, "import_error": import_error, "child": child,
                     "overflow": True})
report.write(line + "\n")
report.flush()
'''


@dataclasses.dataclass(frozen=True)
class HiddenTests:
  """Cases for one function of `module`: each `(args, expected)`."""

  function: str
  cases: Sequence[tuple[tuple, Any]]
  module: str = "solution"

  def harness_input(self, max_report_bytes: int, max_report_line: int,
                    seccomp: Optional[bytes] = None) -> bytes:
    """What the sandbox gets: the arguments only, never the expected values (and the
    filter the harness loads for the solution: `seccomp_keep_dumpable`)."""
    return json.dumps({"module": self.module, "function": self.function,
                       "args": [values.encode(tuple(a)) for a, _ in self.cases],
                       "max_report_bytes": max_report_bytes,
                       "max_report_line": max_report_line,
                       "seccomp": seccomp.hex() if seccomp else None}).encode()


@functools.cache
def harness_source() -> str:
  """The harness run with `python3 -I -B -c`: the modules the interpreter started with,
  the value codec, then the harness itself."""
  return ("import sys\n_STARTUP = frozenset(sys.modules)\n" + inspect.getsource(values)
          + _HARNESS_BODY)


def classify(result: ExecResult, tests: HiddenTests, env_version: str) -> Verdict:
  """Turns one harness run into a verdict; the expected values never left the host."""

  def verdict(status, reward=0.0, **details):
    return Verdict(status, reward, env_version, VERSION,
                   {"exec": {k: getattr(result, k) for k in (
                       "exit_code", "signal", "duration_s", "timed_out", "isolation",
                       "stdout_bytes", "stderr_bytes", "stdout_sha256")},
                    "stderr_tail": result.stderr[-1000:], **details})

  if result.error is not None:
    return verdict(VerdictStatus.INFRA_ERROR, reason=f"sandbox could not run: {result.error}")
  if result.disk_exceeded is not None:  # (the harness killed with it: not the host's doing)
    return verdict(VerdictStatus.FAIL, reason="the solution went past the grading "
                   f"workspace's bounds: {result.disk_exceeded}")
  lines = result.stdout.split("\n")
  if lines[0] != "START":
    why = "before the timeout" if result.timed_out else (
        f"(exit {result.exit_code}, signal {result.signal})")
    return verdict(VerdictStatus.INFRA_ERROR, reason=f"harness did not start {why}")
  if result.timed_out:
    return verdict(VerdictStatus.TIMEOUT, reason="solution ran past the time limit")
  if result.stdout_bytes > len(result.stdout.encode()):
    # The harness caps its report to what the host keeps; more output than that can
    # only be the solution's doing (it never holds the channel, but be strict).
    return verdict(VerdictStatus.FAIL, reason="the report overflowed the output kept",
                   overflow=True)
  try:
    report = json.loads(lines[1])
    results, child = report["results"], report["child"]
    if not isinstance(results, dict) or not isinstance(child, dict):
      raise TypeError("malformed report")
  except RecursionError:  # only the solution's values nest: its doing
    return verdict(VerdictStatus.FAIL, reason="the report nested too deeply to read")
  except (IndexError, ValueError, KeyError, TypeError):
    if result.oom_kills:
      # The sandbox's memory (its processes and the kernel memory they made, files in
      # its tmpfs included) ran out and the kernel killed the harness: only the
      # solution's process and what it started use memory there.
      return verdict(VerdictStatus.FAIL, reason="the solution ran the sandbox out of memory "
                     f"(the kernel killed {result.oom_kills} of its processes, the "
                     "harness among them)")
    if result.isolation == "rlimits":  # (no PID namespace: the solution, its child, can
      # kill it, and one line did, a re-roll for any failing answer; a red team)
      return verdict(VerdictStatus.FAIL, reason=(
          f"the harness died after it started (exit {result.exit_code}, signal "
          f"{result.signal}): without isolation the solution can kill it"))
    return verdict(VerdictStatus.INFRA_ERROR,
                   reason=f"harness died after it started (exit {result.exit_code}, signal "
                          f"{result.signal})")
  if child.get("signal") == 24:  # SIGXCPU: the CPU limit is a time limit
    return verdict(VerdictStatus.TIMEOUT, reason="solution ran past the CPU limit")
  if report.get("import_error"):
    return verdict(VerdictStatus.FAIL, reason=f"solution did not load: {report['import_error']}",
                   child=child)
  odd = report.get("odd_names")
  if odd:
    return verdict(VerdictStatus.FAIL, child=child, reason=(
        "the modules the solution made hold names that are not ASCII identifiers, or "
        f"that read alike, or could not be read ({', '.join(map(str, odd[:5]))}): names "
        "made from strings at run time read to a judge as the names they look like; "
        "write names in ASCII, apart"))
  read = report.get("read_names") or []
  if results and ("imported" not in read or (
      len(results) >= len(tests.cases) and "at_end" not in read)):
    return verdict(VerdictStatus.FAIL, child=child, reason=(
        "the solution's process gave results without its names read (the harness reads "
        f"them once it is imported and after its last case; the process ended {child})"))
  if not tests.cases:
    return verdict(VerdictStatus.INFRA_ERROR, reason="the task has no hidden cases")
  outcomes = {}
  for i, (_, expected) in enumerate(tests.cases):
    got = results.get(str(i))
    if got is None:
      outcomes[i] = ("no result (the results overflowed what the harness reads)"
                     if report.get("overflow") else
                     "no result (the solution's process ended first)")
    elif "error" in got:
      outcomes[i] = f"raised {got['error']}"
    else:
      try:
        value = values.decode(got["value"])
        same = values.strict_equal(value, expected)
        outcomes[i] = "pass" if same else (
            f"returned {value!r:.100} of type {type(value).__name__}")
      except (ValueError, TypeError, OverflowError, RecursionError) as e:
        outcomes[i] = f"unreadable value: {type(e).__name__}: {e}"[:200]
  passed = sum(o == "pass" for o in outcomes.values())
  status = VerdictStatus.PASS if passed == len(tests.cases) and not report.get(
      "overflow") else VerdictStatus.FAIL
  overflow = bool(report.get("overflow"))
  return verdict(status, 1.0 if status == VerdictStatus.PASS else 0.0, passed=passed,
                 total=len(tests.cases), cases={str(i): o for i, o in outcomes.items()},
                 child=child, overflow=overflow, **({"reason": (
                     "the solution's results overflowed what the harness reads")}
                     if overflow else {}))


MAX_REPORT_BYTES = 1 << 20  # of results the harness reads (its default)


def report_line_bytes(max_report_bytes: int) -> int:
  """The longest report line the harness writes: results of `max_report_bytes`, each
  case's keyed by its number rather than tagged with it, and the report's other fields."""
  return max_report_bytes + (64 << 10)


def report_bytes(encoded: Sequence[Any]) -> int:
  """About what a report of these expected values (`values.encode`d) takes of what the
  harness reads (each case's line as the harness writes it): a task whose correct
  answers do not fit can never pass."""
  lines = sum(len(json.dumps({"i": i, "value": e})) + 1 for i, e in enumerate(encoded))
  return lines + lines // 10 + 256  # (a float a correct answer prints longer, 0.1 + 0.2)


class PythonTestVerifier:
  """Grades Python files against hidden cases in a fresh sandbox workspace from `pool`."""

  version = VERSION

  def __init__(self, pool: SandboxPool, *, timeout_s: float = 20.0, retries: int = 2,
               max_report_bytes: int = MAX_REPORT_BYTES):
    self.pool = pool
    self.timeout_s = timeout_s
    self.retries = retries
    self.max_report_bytes = max_report_bytes
    self.infra_errors = 0

  async def grade(self, files: dict[str, bytes], tests: HiddenTests, *,
                  env_version: str) -> Verdict:
    last: Optional[Verdict] = None
    for attempt in range(1, self.retries + 2):
      try:
        async with self.pool.acquire() as sb:
          last = await self.grade_in(sb, files, tests, env_version=env_version)
      except asyncio.CancelledError:
        raise
      except Exception as e:  # the grader failed, not the solution
        last = Verdict(VerdictStatus.INFRA_ERROR, 0.0, env_version, VERSION,
                       {"reason": f"grader raised {type(e).__name__}: {e}"})
      last.attempts = attempt
      if not last.is_infra_error:
        return last
      self.infra_errors += 1
    return last

  async def grade_in(self, sb: Sandbox, files: dict[str, bytes], tests: HiddenTests, *,
                     env_version: str) -> Verdict:
    """One grading run in the empty workspace `sb`."""
    stop = threading.Event()

    def copy():
      for name, data in files.items():
        if stop.is_set():
          return
        sb.write_file(name, data)

    # Off the event loop (megabytes of files held the worker's other episodes). A
    # grading cancelled meanwhile stops the copy and waits for the file being written:
    # the sandbox is torn down next, and a copy going on would write the files again
    # on the host's disk, outside the workspace's quota.
    copying = asyncio.ensure_future(asyncio.to_thread(copy))
    try:
      try:
        await asyncio.shield(copying)
      except asyncio.CancelledError:
        stop.set()
        with contextlib.suppress(Exception):  # (cancelled: its outcome is not graded)
          await waits.to_the_end(copying)
        raise
    except OSError as e:
      if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.ENAMETOOLONG, errno.EFBIG) or (
          e.errno in (errno.ENOSPC, errno.EDQUOT) and not sb.has_quota):
        raise  # (a workspace without a quota of its own: a full disk is the host's, red
        # team 28: a correct answer graded a fail, and one sample filling the disk failed
        # every other being graded)
      # The files the policy left do not fit a workspace like its own: its doing.
      return Verdict(VerdictStatus.FAIL, 0.0, env_version, VERSION,
                     {"reason": f"the files cannot be copied to grade: {e.strerror}"})
    # The report line must fit in what the sandbox keeps of stdout (after "START\n"): as
    # much as the harness reads of results (it was the commands' 16 KiB, and a correct
    # solution of 600 small cases, or one 20,000-character answer, failed as overflowed).
    report_line = report_line_bytes(self.max_report_bytes)
    result = await sb.run([sb.python, "-I", "-B", "-c", harness_source()], timeout=self.timeout_s,
                          stdin=tests.harness_input(self.max_report_bytes, report_line,
                                                    seccomp_keep_dumpable()),
                          pid1=True, trusted_init=True, keep_stdout=report_line + 64)
    # (off the event loop: a report of a megabyte, 55,000 set items, took 165 ms to read)
    return await asyncio.to_thread(classify, result, tests, env_version)
