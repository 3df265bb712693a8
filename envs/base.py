"""The environment protocol, task specs, verdicts and the registry of environments.

An environment is a small async protocol:
  `reset(task) -> Observation` (messages and the tool schemas offered),
  `step(action) -> StepResult(observation, reward, terminated, truncated, info)`,
  `verify() -> Verdict` once the episode is over, and `close()`.
Terminated (the task reached an end) and truncated (out of turns or time) are
kept apart. Every result carries the environment's and verifier's versions.

Standard library only: this tier runs on CPU hosts without JAX.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import difflib
import enum
import hashlib
import inspect
import json
import math
import re
import string
from typing import Any, Callable, Optional, Sequence

from jaxagent.toolcalls import FINITE_JSON


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """One task: which environment, its parameters, and the task's version."""

  id: str
  env: str
  params: dict = dataclasses.field(default_factory=dict)
  version: str = "1"

  @classmethod
  def from_dict(cls, d: dict) -> "TaskSpec":
    unknown = set(d) - {"id", "env", "params", "version"}
    if unknown:
      near = [f"{k!r}: did you mean {m[0]!r}?" for k in sorted(unknown, key=str)
              if (m := difflib.get_close_matches(str(k), ["id", "env", "params", "version"],
                                                  n=1))]
      raise ValueError(f"task spec has unknown keys {sorted(unknown, key=str)}"
                       + (f" ({'; '.join(near)})" if near else ""))
    for key in ("id", "env"):
      if not isinstance(d.get(key), str) or not d[key]:
        raise ValueError(f"task spec needs a non-empty string {key!r}: {d!r}")
    if not isinstance(d.get("params", {}), dict):
      raise ValueError(f"task {d['id']}: params must be an object")
    version = d.get("version", "1")
    if isinstance(version, bool) or not isinstance(version, (str, int)):
      # (`{"a": 1}` was taken as its text; red team 115)
      raise ValueError(f"task {d['id']}: version must be a string or an integer, got "
                       f"{version!r:.80}")
    return cls(d["id"], d["env"], dict(d.get("params", {})), str(version))

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


# What an environment's `reset` raises for a task whose parameters have the wrong type or
# shape (`low: [1]`, a question with a stray `{0}`, a number past a float's range): taken for the task data's fault
# (`jaxagent.errors.TaskError`, the run stops naming the task), though a bug of an
# environment's own code that raises one of these reads the same.
BAD_TASK = (ValueError, TypeError, KeyError, IndexError, OverflowError)


class CannotStart(ValueError):
  """A task its environment will not start: `reset` raised one of BAD_TASK (`cannot_start`
  says where), or a worker refused it so. `why` is the cause alone."""

  def __init__(self, message: str, why: Optional[str] = None):
    super().__init__(message)
    self.why = why or message


def failure(e: BaseException) -> str:
  """`file:line: Type: message` of what an environment raised (`raised_at`); a task that
  cannot start, its message alone, which says where already (it was prefixed with the
  plumbing's own line: "envs/waits.py:254: CannotStart: task 'x' cannot start: ...", a
  new user)."""
  if isinstance(e, CannotStart):
    return str(e)
  return f"{raised_at(e)}{type(e).__name__}: {e}"


def cannot_start(task: "TaskSpec", e: BaseException) -> CannotStart:
  """The CannotStart for `task`, whose environment's `reset` raised `e` (one of BAD_TASK)."""
  return CannotStart(f"task {task.id!r} cannot start: {failure(e)}", failure(e))


def task_text(template: Any, field: str, task_id: str, **values: Any) -> str:
  """A task's text parameter `template` (its `field`) with each `{name}` of `values` filled
  in. Plain fields only: a format spec, a conversion, an attribute or an index is a
  ValueError naming it (`{low:>99999999999}` took gigabytes on a worker, its failure
  read as the worker's; `{low.__class__}` read attributes: red team 115)."""
  if not isinstance(template, str):
    raise TypeError(f"task {task_id}: {field} must be a string, got {template!r}")
  try:
    parts = list(string.Formatter().parse(template))
  except ValueError as e:
    raise ValueError(f"task {task_id}: {field}: {e}") from None
  out = []
  for literal, name, spec, conversion in parts:
    out.append(literal)
    if name is None:
      continue
    if name not in values or spec or conversion:
      written = "{" + name + (f"!{conversion}" if conversion else "") + (
          f":{spec}" if spec else "") + "}"
      raise ValueError(f"task {task_id}: {field}: {written} is not one of "
                       f"{', '.join('{' + k + '}' for k in values)} (plain fields only; "
                       "{{ and }} write braces)")
    out.append(str(values[name]))
  return "".join(out)


def task_known(params: dict, known, task_id: str) -> None:
  """A ValueError naming a task's parameters that are not among `known` (with the nearest
  known name): a misspelt one was played at its default without a word (`max_turn`
  capped no turns; a misspelt `secrt` drew a random secret)."""
  unknown = sorted(set(params) - set(known))
  if unknown:
    near = {k: difflib.get_close_matches(k, sorted(known), n=1) for k in unknown}
    hints = [f"{k!r}: did you mean {m[0]!r}?" for k, m in near.items() if m]
    raise ValueError(f"task {task_id}: unknown parameters {unknown}; known: {sorted(known)}"
                     + (f" ({'; '.join(hints)})" if hints else ""))


def task_int(params: dict, key: str, default: int, task_id: str) -> int:
  """A task's integer parameter `key` (`default` when it has none): an integer, or a
  float or string that is one exactly. Anything else is a ValueError naming it
  (`low: 1e400` was an OverflowError read as the worker's failure, `max_turns: 2.5`
  was played as 2, `true` as 1; red team 115)."""
  value = params.get(key, default)
  if isinstance(value, int) and not isinstance(value, bool):
    return value
  if isinstance(value, float) and value.is_integer():  # (never inf or nan)
    return int(value)
  if isinstance(value, str):
    with contextlib.suppress(ValueError):
      return int(value)
  raise ValueError(f"task {task_id}: {key} must be an integer, got {value!r:.80}")


def task_number(params: dict, key: str, default: float, task_id: str) -> float:
  """A task's real parameter `key` (`default` when it has none): a finite number, or a
  string of one; anything else (nan, inf, a bool) is a ValueError naming it."""
  value = params.get(key, default)
  number = None
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    with contextlib.suppress(OverflowError):
      number = float(value)
  elif isinstance(value, str):
    with contextlib.suppress(ValueError):
      number = float(value)
  if number is None or not math.isfinite(number):
    raise ValueError(f"task {task_id}: {key} must be a finite number, got {value!r:.80}")
  return number


def _float_sized_int(literal: str) -> int:
  value = int(literal)  # (past 4300 digits Python refuses it itself: a ValueError)
  try:
    float(value)
  except OverflowError:
    raise ValueError(f"{literal[:20]}... ({len(literal)} digits) overflows a float") from None
  return value


def load_tasks(path: str, unique: bool = False) -> list[TaskSpec]:
  """Reads a JSONL task file; errors name the line. NaN, Infinity and numbers (real or
  whole) that overflow a float are refused (a `process_reward: NaN` reached the advantages).
  `unique`: a task id on two lines is refused (an evaluation's figures are by task id).
  Every bad line is said (the first `BAD_LINES_SAID`, one per line, and how many more):
  the first alone made a file of several mistakes one run each (a new user)."""
  tasks, lines, bad = [], {}, []
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(_text_lines(f, path), 1):
      if not line.strip():
        continue
      try:
        task = TaskSpec.from_dict(json.loads(line, **FINITE_JSON, parse_int=_float_sized_int))
      except json.JSONDecodeError as e:  # (its own "line 1" is this line's)
        bad.append(f"{path}:{n}: not a JSON object (column {e.colno}: {e.msg})")
        continue
      except ValueError as e:
        bad.append(f"{path}:{n}: {e}")
        continue
      if unique and task.id in lines:
        bad.append(f"{path}:{n}: task id {task.id!r} is line {lines[task.id]}'s too (each "
                   "task needs its own id)")
        continue
      tasks.append(task)
      lines[task.id] = n
  if len(bad) == 1:
    raise ValueError(bad[0])
  if bad:
    more = len(bad) - BAD_LINES_SAID
    raise ValueError(f"{len(bad)} bad lines in {path}:\n  " + "\n  ".join(bad[:BAD_LINES_SAID])
                     + (f"\n  (and {more} more)" if more > 0 else ""))
  return tasks


BAD_LINES_SAID = 10  # the bad lines of a task file said at once


def _text_lines(f, path: str):
  """`f`'s lines; ValueError naming the file where it is not UTF-8 text (the decoder's
  error named none: a red team)."""
  try:
    yield from f
  except UnicodeDecodeError as e:
    raise ValueError(f"{path}: not a task file (JSON lines of UTF-8 text): byte "
                     f"{e.object[e.start:e.start + 1]!r} ({e.reason})") from None


def write_tasks(path: str, tasks: list[TaskSpec]) -> None:
  with open(path, "w") as f:
    for t in tasks:
      f.write(json.dumps(t.to_dict()) + "\n")


def task_file_parser(prog: str, what: str):
  """A task generator's command line (`python -m envs.guess_number`, ...): `--out FILE`,
  required (its default was the bundled file a run trains on, overwritten unasked: a new
  user), `-n` tasks (>= 1) and `--seed`; each generator adds its own options."""
  import argparse

  from jaxagent.cli_args import positive_int

  ap = argparse.ArgumentParser(prog=prog, allow_abbrev=False,
                               description=f"Write {what} tasks as JSONL.",
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  ap.add_argument("--out", required=True, default=argparse.SUPPRESS,
                  help="the JSONL file to write (replaced if there)")
  ap.add_argument("-n", type=positive_int, default=256, help="how many tasks")
  ap.add_argument("--seed", type=int, default=0, help="the tasks' random seed")
  return ap


def write_task_file(prog: str, path: str, tasks: list[TaskSpec]) -> int:
  """Writes `tasks` to `path` for a generator's command line: its exit status, a file
  that cannot be written said in one line (it was a traceback)."""
  import sys

  try:
    write_tasks(path, tasks)
  except OSError as e:
    print(f"{prog}: --out: cannot write {path}: {e.strerror or e}", file=sys.stderr)
    return 2
  print(f"wrote {len(tasks)} tasks to {path}")
  return 0


@dataclasses.dataclass
class Observation:
  """What the agent sees: new messages (OpenAI shape) and the tools it may call."""

  messages: list[dict]
  tools: list[dict] = dataclasses.field(default_factory=list)


class VerdictStatus(str, enum.Enum):
  PASS = "pass"
  FAIL = "fail"  # a wrong answer
  TIMEOUT = "timeout"  # the solution ran out of time
  INFRA_ERROR = "infra_error"  # the grader itself failed: drop or retry, never score


def text_safe(s: str) -> str:
  """`s`, with any lone surrogate (not Unicode text: a policy's `raise
  ValueError("\\ud800")` read back from JSON) written as its `\\u` escape: what UTF-8
  cannot encode must not fail an answer, a log line or a print."""
  try:
    s.encode("utf-8")
    return s
  except UnicodeEncodeError:
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


def json_safe(obj: Any) -> Any:
  """`obj` with every float that JSON cannot carry (inf, nan: say, a policy's 400-digit
  answer read as a float) written as its repr, and every string as `text_safe` makes
  it, so that it can be sent and logged."""
  if isinstance(obj, float) and not math.isfinite(obj):
    return repr(obj)
  if isinstance(obj, str):
    return text_safe(obj)
  if isinstance(obj, dict):
    return {text_safe(k) if isinstance(k, str) else k: json_safe(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [json_safe(v) for v in obj]
  if hasattr(obj, "dtype") and callable(getattr(obj, "tolist", None)):
    # (NumPy's and JAX's scalars and arrays, which in-process code takes as numbers: an
    # np.float32 in a step's info was a worker's 500; a reviewer)
    return json_safe(obj.tolist())
  return obj


class ActionTooLarge(ValueError):
  """A worker refused a step's action as larger than its body bound (413): the policy's
  output, its truncation (`jaxagent.agent.MeasuredEnv.step`), not a bad call that stops
  the run (a reviewer: a degenerate policy's escaped bytes could pass 8 MiB)."""


class BadReward(ValueError):
  """An environment gave a reward that is not a finite number (a NaN, a string), or a
  verdict whose status is no `VerdictStatus`: its bug, or its task data's; never
  trained."""


# The largest reward the learner holds: it computes in float32, where 1e39 is inf (a
# reward finite in Python stopped a run with a non-finite update: red team 37).
REWARD_MAX = 3.4028234663852886e38  # (float32's largest)


def check_reward(value, what: str) -> None:
  """A number of any kind (NumPy's and JAX's scalars too), finite in float32 (the
  learner's); not text or a bool."""
  try:
    finite = not isinstance(value, (str, bytes, bool)) and math.isfinite(float(value))
  except (TypeError, ValueError, OverflowError):  # (an int past a float's range: an
    # unnamed traceback; a red team)
    finite = False
  if not finite:
    try:
      shown = repr(value)[:100]
    except ValueError:  # (an int past the digits Python writes)
      shown = "a number too long to show"
    raise BadReward(f"{what} must be a finite number, got {shown} "
                    f"({type(value).__name__})")
  if abs(float(value)) > REWARD_MAX:
    raise BadReward(f"{what} must be within float32's range (the learner's, "
                    f"+-{REWARD_MAX:.4g}), got {float(value)!r}")


@dataclasses.dataclass
class Verdict:
  status: VerdictStatus
  reward: float
  env_version: str
  verifier_version: str
  details: dict = dataclasses.field(default_factory=dict)
  attempts: int = 1

  def __post_init__(self):
    try:  # (a status written as its value, "pass", is that status)
      self.status = VerdictStatus(self.status)
    except ValueError:  # (it failed later, as AttributeError: 'str' has no 'value')
      raise BadReward(f"a verdict's status must be a VerdictStatus (one of "
                      f"{', '.join(v.value for v in VerdictStatus)}), got {self.status!r}") \
          from None
    check_reward(self.reward, "a verdict's reward")
    self.reward = float(self.reward)  # (an np.float32 as a number of JSON's and Python's)
    # (its reasons quote what a solution raised or printed: JSON and UTF-8 text,
    # whatever it was)
    self.details = json_safe(self.details)

  @property
  def is_infra_error(self) -> bool:
    return self.status == VerdictStatus.INFRA_ERROR

  def to_dict(self) -> dict:
    d = json_safe(dataclasses.asdict(self))
    d["status"] = self.status.value
    return d


def trained_rewards(step_rewards: list[float], verdict: "Verdict | dict") -> list[float]:
  """The per-turn rewards the learner trains on, the one reward contract of every environment.

  A step's reward is that turn's process reward; the verifier's verdict carries the
  episode's outcome (terminal) reward, added here to the last turn, so chunked-MDP
  reward-to-go carries it back to every earlier turn and an episode's total is
  `sum(process rewards) + verdict reward`. An `infra_error` verdict is not a score:
  it raises, and the caller retries or drops the episode.
  """
  status = verdict.status.value if isinstance(verdict, Verdict) else verdict.get("status")
  if status == VerdictStatus.INFRA_ERROR.value:
    raise ValueError("an infra_error verdict has no reward to train on")
  terminal = float(verdict.reward if isinstance(verdict, Verdict) else verdict.get("reward", 0.0))
  rewards = [float(r) for r in step_rewards] or [0.0]
  rewards[-1] += terminal
  if not all(math.isfinite(r) and abs(r) <= REWARD_MAX for r in rewards):
    # (an environment's bug: the run stops)
    raise ValueError(f"rewards must be finite numbers within float32's range (the "
                     f"learner's): steps {list(step_rewards)}, verdict {terminal}")
  return rewards


@dataclasses.dataclass
class StepResult:
  observation: Observation
  reward: float
  terminated: bool
  truncated: bool
  info: dict = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    # An environment's bug (or its task data's): named, never trained.
    check_reward(self.reward, "a step's reward")
    self.reward = float(self.reward)  # (an np.float32 as a number of JSON's and Python's)


class Env(abc.ABC):
  """Base class of environments. Subclasses set `name`, `version`, `verifier_version`."""

  name: str = "env"
  version: str = "1"
  verifier_version: str = "1"
  needs_resources: bool = False
  # Shows its passes to `resources.judge` when one is set (env.judge): a run that sets a
  # judge for environments of which none does is told so.
  asks_judge: bool = False
  # The outcome of an episode the policy cut before it answered (its time ran out; a
  # black-box conversation outgrew the context), in place of a verdict: the steps'
  # process rewards are kept. No higher than a wrong answer's outcome: an environment
  # whose wrong answers pay -1 sets -1 here, or stalling pays better than answering
  # (a reviewer: fixed at 0, it did).
  cut_reward: float = 0.0
  # A run resets each task of this environment once at its start (for a few seconds at
  # most), so that a bad parameter is named before training; False for one whose reset
  # is costly or has effects beyond itself (one that needs shared resources never is).
  check_at_start: bool = True

  def __init__(self):
    self.task: Optional[TaskSpec] = None
    self.turns = 0
    self.done = False
    self.reset_counters()

  def reset_counters(self) -> None:
    self.counters = {"tool_calls": 0, "invalid_tool_calls": 0, "tool_errors": 0}

  def begin_turn(self) -> None:
    """Counts a turn; stepping a finished episode is an error."""
    if self.done:
      raise RuntimeError("episode is over: reset first")
    self.turns += 1

  @abc.abstractmethod
  async def reset(self, task: TaskSpec) -> Observation:
    ...

  @abc.abstractmethod
  async def step(self, action: str) -> StepResult:
    """`action`: the model's text for this turn (tool calls inside it are parsed here)."""

  @abc.abstractmethod
  async def verify(self) -> Verdict:
    ...

  async def close(self) -> None:
    pass

  def reference_action(self) -> str:
    """The next action of a perfect agent (for task filtering); optional."""
    raise NotImplementedError(f"{self.name} has no reference policy")

  def shortcuts(self) -> dict[str, list[str]]:
    """Scripted plays of the task just reset that must not pass, by what each tries (a
    constant answer, the input given back): `envs.filter` drops a task one of them passes
    (a task whose every case expected True paid `return True`). None by default."""
    return {}

  def versions(self) -> dict:
    return {"env": f"{self.name}@{self.version}", "verifier": f"{self.name}@{self.verifier_version}",
            "task": self.task.version if self.task else None}

  def state(self) -> dict:
    """What the environment's next answers depend on besides its task (subclasses add
    their own)."""
    return {"turns": self.turns, "done": self.done, "counters": self.counters}

  def state_hash(self) -> str:
    """A hash of `state()`: logged with each observation in the token write-ahead log and
    checked when a resumed run replays the episode."""
    payload = json.dumps(self.state(), sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]

  def _info(self, **extra) -> dict:
    return {"versions": self.versions(), "turn": self.turns, **self.counters, **extra}


@dataclasses.dataclass
class EnvResources:
  """Shared, expensive things environments borrow: the sandbox pool (created on first use)."""

  sandboxes: int = 4  # commands running at once
  sandbox_limits: Any = None
  # Run untrusted code with resource limits only where the host cannot isolate it
  # (no bubblewrap, not root): off unless asked for.
  allow_unisolated: bool = False
  # A sandboxed command the host's OOM killer takes is an infrastructure error (not the
  # command's failure) where this says the host's memory is the pool's and its limits
  # fit it (`envs.pool.SandboxPool`): an env worker's --host-oom-is-infra.
  host_oom_is_infra: bool = False
  # Cgroups delegated to this process (v1 memory or cpu hierarchy directories, or v2
  # directories with the controllers in their subtree): each sandbox's processes are held
  # to their limits together below them, even where this process is not root
  # (`envs.pool.SandboxPool`'s `cgroup_parents`; an env worker's --cgroup).
  cgroups: tuple = ()
  sandbox_root: Optional[str] = None  # where workspaces go (default: a new temporary folder)
  # A worker that is not root: each workspace a tmpfs held in a user namespace of its
  # own (True), or a folder on the host's disk that a watch bounds (False); None: the
  # first where the host allows it (`envs.pool.SandboxPool`'s `own_filesystem`).
  own_filesystem: Optional[bool] = None
  # An `envs.judge.LLMJudge` that environments with tests show their passes to (ROLL's
  # false-positive check); None: tests alone decide.
  judge: Any = None
  _pool: Any = None

  def pool(self):
    if self._pool is None:
      from envs.pool import SandboxPool
      from envs.sandbox import Limits

      self._pool = SandboxPool(self.sandboxes, limits=self.sandbox_limits or Limits(),
                               allow_unisolated=self.allow_unisolated, root=self.sandbox_root,
                               host_oom_is_infra=self.host_oom_is_infra,
                               cgroup_parents=tuple(self.cgroups),
                               own_filesystem=self.own_filesystem)
    return self._pool

  def slot_freed_at(self) -> float:
    """When its sandbox pool last freed a slot (`time.monotonic`; -inf before it has a
    pool)."""
    return self._pool.last_freed if self._pool is not None else -math.inf

  def close(self) -> None:
    if self._pool is not None:
      self._pool.close()
      self._pool = None


@dataclasses.dataclass(frozen=True)
class Latency:
  """Made-up time every environment step takes (benchmarks of asynchrony).

  `distribution`: none | constant (every step sleeps `median_s`) | lognormal (median
  `median_s`, log-space spread `sigma`: sigma 1.5 puts the 99th percentile at 33x the
  median). Every sleep is capped at `max_s` (the tail's end). Seeded per episode.
  """

  distribution: str = "none"
  median_s: float = 0.05
  sigma: float = 1.5
  max_s: float = 2.0
  seed: int = 0

  DISTRIBUTIONS = ("none", "constant", "lognormal")

  def __post_init__(self):
    if self.distribution not in self.DISTRIBUTIONS:
      raise ValueError(f"latency distribution: unknown {self.distribution!r}; known: "
                       f"{', '.join(self.DISTRIBUTIONS)}")
    if self.median_s < 0 or self.max_s < 0 or self.sigma < 0:
      raise ValueError("latency median_s, sigma and max_s must be >= 0")

  def sampler(self, key: str) -> Callable[[], float]:
    """Seconds to sleep per step, from a generator seeded by `key` (the episode's)."""
    import math
    import random

    rng = random.Random(f"{self.seed}:{key}")
    if self.distribution == "constant":
      return lambda: min(self.median_s, self.max_s)
    if self.distribution == "lognormal":
      mu = math.log(max(self.median_s, 1e-9))
      return lambda: min(rng.lognormvariate(mu, self.sigma), self.max_s)
    return lambda: 0.0


class WithLatency(Env):
  """Any environment whose every step first waits a `Latency` (asyncio: others run)."""

  def __init__(self, env: Env, latency: Latency, key: str = ""):
    # No Env.__init__: the state (task, turns, done, counters) is the wrapped env's.
    self.env, self.latency = env, latency
    self._sample = latency.sampler(key)
    self.name, self.version = env.name, env.version
    self.verifier_version = env.verifier_version
    self.slept_s = 0.0

  task = property(lambda self: self.env.task)
  cut_reward = property(lambda self: self.env.cut_reward)
  turns = property(lambda self: self.env.turns)
  done = property(lambda self: self.env.done)
  counters = property(lambda self: self.env.counters)

  async def reset(self, task: TaskSpec) -> Observation:
    return await self.env.reset(task)

  async def step(self, action: str) -> StepResult:
    import asyncio

    wait = self._sample()
    self.slept_s += wait
    await asyncio.sleep(wait)
    return await self.env.step(action)

  async def verify(self) -> Verdict:
    return await self.env.verify()

  async def close(self) -> None:
    await self.env.close()

  def reference_action(self) -> str:
    return self.env.reference_action()

  def shortcuts(self) -> dict[str, list[str]]:
    return self.env.shortcuts()

  def versions(self) -> dict:
    return self.env.versions()

  def __getattr__(self, name):  # counters, tools and the rest of the wrapped env
    return getattr(self.__dict__["env"], name)


ENVS: dict[str, Callable[..., Env]] = {}


def register(name: str):
  """Class decorator: makes an environment available by `name`."""

  def deco(cls):
    if name in ENVS:
      raise ValueError(f"environment {name!r} is already registered")
    declared = inspect.getattr_static(cls, "cut_reward", 0.0)
    if not hasattr(declared, "__get__"):  # (a property is read per episode, after reset)
      try:
        check_reward(declared, f"environment {name!r}'s cut_reward")
      except BadReward as e:
        raise ValueError(str(e)) from None
    cls.name = name
    ENVS[name] = cls
    return cls

  return deco


class UnknownEnv(KeyError):
  """A task's environment that nobody registered. `said(own)` words it with how a user
  registers one of their own where `own` is (a command with other flags words it its own
  way: eval's hint named flags eval has not, a new user)."""

  OWN = ("name its module in env.imports, or --import for envs.server, envs.play and "
         "envs.filter")

  def __init__(self, name: str, known: list[str]):
    self.name, self.known = name, known
    super().__init__(self.said())

  def said(self, own: str = OWN) -> str:
    close = difflib.get_close_matches(self.name, self.known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"unknown environment {self.name!r}{hint}; known: {self.known} (an environment "
            f"of your own: {own})")

  def __str__(self) -> str:  # (unquoted, as any error's message)
    return self.args[0]


def make(name: str, resources: Optional[EnvResources] = None) -> Env:
  """A new environment by registered name; those that need shared resources get them."""
  _load_builtins()
  if name not in ENVS:
    raise UnknownEnv(name, sorted(ENVS))
  cls = ENVS[name]
  if getattr(cls, "needs_resources", False):
    if resources is None:
      raise ValueError(f"environment {name!r} needs EnvResources (a sandbox pool)")
    return cls(resources)
  return cls()


def _load_builtins() -> None:
  # Built-in environments register themselves on import.
  from envs import calculator, guess_number, python_tests  # noqa: F401


_FILE_MODULES: dict[str, Any] = {}  # real path -> module, for environments loaded from files


def load_modules(entries: Sequence[str]) -> list[str]:
  """Imports the modules that register environments of a user's own (`@register(name)`
  on an `Env` subclass): each entry a module name found on `sys.path` (`my_envs.words`)
  or a Python file (`envs_of_mine/words.py`, relative to the working directory). A module
  is imported once however often it is named. Returns the names of the environments they
  registered. An entry that cannot be imported (no such module or file, or its code
  raises, a name taken included) raises ValueError naming the entry and where it failed."""
  _load_builtins()  # first, so that a module taking a built-in's name is the one refused
  before = set(ENVS)
  for entry in entries:
    import_entry(entry)
  return sorted(set(ENVS) - before)


def import_entry(entry: str) -> Any:
  """The module `entry` names: a module name found on `sys.path`, or a Python file
  (relative to the working directory), imported once however often it is named.
  ValueError naming the entry and where it failed (no such module or file, or its code
  raises)."""
  import importlib
  import importlib.util
  import os
  import sys

  if not isinstance(entry, str) or not entry.strip():
    raise ValueError(f"an import must be a module name or a .py file, got {entry!r}")
  path = os.path.realpath(entry) if entry.endswith(".py") or os.sep in entry else None
  if path is not None and not os.path.isfile(path):  # (a run's, evaluated from another
    # directory: said with no hint why; a new user)
    raise ValueError(f"{entry!r}: no such file" + ("" if os.path.isabs(entry) else (
        f" (a relative path, read from the working directory {os.getcwd()})")))
  if path in _FILE_MODULES:
    return _FILE_MODULES[path]
  try:
    if path is None:
      return importlib.import_module(entry)
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    name = f"jaxagent_envs_{stem}_{hashlib.sha256(path.encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses and pickling look their module up)
    try:
      spec.loader.exec_module(module)
    except BaseException:
      del sys.modules[name]
      raise
    _FILE_MODULES[path] = module
    return module
  except Exception as e:
    missing = getattr(e, "name", None) if isinstance(e, ModuleNotFoundError) else None
    if missing and (entry == missing or entry.startswith(missing + ".")):
      raise ValueError(f"{entry!r}: no module named {missing!r} on the path (name a "
                       "module, or a .py file)") from None
    raise ValueError(f"{entry!r}: {failure(e)}") from None


def add_import_flag(parser) -> None:
  """`--import MODULE` (repeatable) on an environment tier command line: `load_modules`."""
  parser.add_argument("--import", dest="imports", action="append", default=[],
                      metavar="MODULE", help="a module name or .py file that registers "
                      "environments of your own (repeat for more)")


def raised_at(e: BaseException) -> str:
  """`file:line: ` where `e` was raised, the innermost frame outside the environment
  tier's plumbing (this file, the worker's client): the `@register` line of a name taken
  twice, the line of an environment's own `reset` that failed; a syntax error's own."""
  import os
  import sysconfig
  import traceback

  if isinstance(e, SyntaxError) and e.filename:
    return f"{e.filename}:{e.lineno}: "
  plumbing = {__file__, os.path.join(os.path.dirname(__file__), "server.py")}
  frames = [f for f in traceback.extract_tb(e.__traceback__)
            if f.filename not in plumbing and not f.filename.startswith("<")]  # (generated
  # code: a dataclass's __init__ checking what the environment's line passed it)
  # The standard library's lines are where a call of the environment's failed, not the
  # environment's (json.loads of an action: the decoder's line, not the caller's)
  stdlib = tuple(os.path.join(sysconfig.get_paths()[k], "") for k in ("stdlib", "platstdlib"))
  frames = [f for f in frames if not f.filename.startswith(stdlib)] or frames
  if not frames:
    return ""
  path = frames[-1].filename
  if path.startswith(os.getcwd() + os.sep):
    path = os.path.relpath(path)
  return f"{path}:{frames[-1].lineno}: "
