"""The asynchronous rollout scheduler, its buffer, and the batcher.

Tasks come from a grain iterator; each task is played by a group of G
episodes (one asyncio task each) for group-relative advantages, under caps on
episodes in flight (and, through the environment's sandbox pool and the
server's queue, on sandboxes and requests).

Modes:
- `sync`: on-policy: start a step's groups on the current weights, wait for all.
- `async`: groups keep running while the learner trains; a group is accepted
  only if the learner's version minus its oldest token's version is at most the
  staleness bound (`max_staleness`, or the sync_every - 1 versions the learner runs
  ahead of the servers between weight syncs if more), and no more groups are started
  than that bound lets through ((served version + bound + 1) x groups_per_step in all,
  as AReaL, plus the groups the filters dropped and replaced, less what short steps
  did not take). When the version moves, groups the
  bound can no longer accept are dropped at once (running ones cancelled) and
  replaced, so a straggler does not hold capacity until it finishes.
- `window`: async, but a batch is taken only from the oldest `window` groups
  in flight, so long episodes are not starved and short ones do not dominate.
Weight updates reach episodes mid-flight (partial rollout): their later turns
run on the new weights and every token keeps the version that produced it.

An episode that fails for infrastructure reasons (an `InfraError`: server call,
overload, turn deadline, environment worker, sandbox; or an `infra_error`
verdict) is retried, then dropped and counted by kind, never scored 0; a group left
with too few episodes by such drops has its task played again once (later, as a fresh
group); a dropped episode is retried after `retry_backoff_s`, doubled each time. When
more than `max_infra_fraction` of the last `infra_window` episodes were dropped so, for
`infra_grace_s`, the infrastructure is down: `next_groups` raises `InfraOutage` and the
run stops
(a run that went on would consume its tasks on episodes that are all dropped). Any other
exception an episode raises is a bug: `next_groups` raises it and the run stops. Filters drop stale groups and groups whose rewards are all equal;
dropped groups are replaced by fresh ones until the step has its groups
(dynamic sampling, at most `max_sample_rounds` x groups_per_step consumed).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import time
import types
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from jaxagent import advantages
from jaxagent.agent import FIRST_PROMPT_TOO_LONG, Episode
from jaxagent.batch import TrajectoryBatch, pack, row_ladder, take_rows
from jaxagent.config import AdvantageConfig, RolloutConfig, unknown_value
from jaxagent.errors import EpisodeBug, InfraOutage, RunWriteFailed, TaskError


# Why a scheduler drops an episode or a group (`RolloutScheduler.dropped`; also counted
# by infrastructure failure's kind, `infra_<kind>`).
DROP_REASONS = ("infra_error", "stale", "too_few_valid", "future_version", "no_signal")

# What to look at when most drops are of one kind (InfraOutage's message).
_OUTAGE_HINT = "check the rollout servers, environment workers and sandbox"
_OUTAGE_HINTS = {
    "env_worker": "check the environment workers (env.urls)",
    "server": "check the rollout servers (serving.urls, or the in-process engine)",
    "server_overload": "the rollout servers turn turns away (their queue is full)",
    "engine_dead": "the in-process engine's loop died and cannot recover (its log says "
                   "why): restart the run",
    "turn_deadline": "turns on the rollout servers did not move for agent.turn_deadline_s "
                     "(queued or stalled)",
    "episode_deadline": "episodes wait on the servers past agent.episode_deadline_s",
    "episode_wall": "episodes wait on the servers past agent.episode_deadline_s",
    "sandbox": "check the sandbox (env.sandboxes, the host's isolation)",
    "verifier": "the grader fails (its sandbox, or env.judge)",
    # (a black-box agent's harness: `agent.kind`)
    "gateway_refused": "the gateway refused the black-box agent's requests (a bug of the "
                       "agent.kind harness's: its last answer below)",
    "no_turns_recorded": "no turn of the black-box agent was recorded under its session: "
                         "its calls must carry the header X-Session-Id with the session_id "
                         "it is given (agent.kind)",
    "agent_stuck": "episodes were cut while the black-box agent's own code held them (no "
                   "request on the gateway, no environment call under way: agent.kind)",
    "session_evicted": "the rollout servers dropped black-box sessions' records while "
                       "they played (raise serving.session_max_bytes or "
                       "serving.max_sessions)",
}


class ProducerFailed(RuntimeError):
  """The async scheduler could not start the next group (a bug)."""


@dataclasses.dataclass
class Group:
  index: int
  task: object  # envs.base.TaskSpec
  episodes: list[Episode] = dataclasses.field(default_factory=list)
  started_version: int = 0
  done: bool = False
  retries: int = 0
  dropped_episodes: int = 0
  task_handle: Optional[asyncio.Task] = dataclasses.field(default=None, repr=False)
  # What the run's totals counted it as once taken: a drop's reason (the filters'), or
  # "nothing_trained" (a step it gave nothing); None while accepted or not taken.
  counted_as: Optional[str] = None
  requeued: bool = False  # (the infrastructure left it short: its task played again)

  @property
  def rewards(self) -> list[float]:
    return [e.reward for e in self.episodes]

  def min_version(self) -> Optional[int]:
    vs = [e.min_version() for e in self.episodes]
    vs = [v for v in vs if v is not None]
    return min(vs) if vs else None

  def max_version(self) -> Optional[int]:
    vs = [s.max_version() for e in self.episodes for s in e.segments]
    vs = [v for v in vs if v is not None]
    return max(vs) if vs else None


class RolloutScheduler:
  """Runs groups of episodes and hands finished, filtered groups to the learner."""

  def __init__(self, cfg: RolloutConfig, tasks: Iterator, play: Callable, *,
               requeue: Optional[list] = None, advantage: Optional[AdvantageConfig] = None):
    """`play(task, session_id, group_id) -> Episode` plays one episode (async);
    `advantage`: the run's estimator, which says what `filter_equal_rewards` drops."""
    self.cfg = cfg
    self.advantage = advantage or AdvantageConfig()
    self.tasks = tasks
    self.play = play
    self.requeue = collections.deque(requeue or [])  # tasks to run before the iterator's
    self.version = 0  # the learner's policy version (after its last step)
    # The version the servers serve (the last weight sync): behind `version` by up to
    # sync_every - 1 between syncs. Groups start on it; staleness is the learner's.
    self.served = 0
    # Groups the steps that trained did not take (fewer than groups_per_step accepted
    # when max_sample_rounds ran out): the capacity rule counts a whole step's a version,
    # and each short step left that many extra for good (a reviewer of red team 20).
    self.shortfall = 0
    self.started = 0
    # The next group's number (in session ids `g<number>-...`); a resumed run goes on
    # from its checkpoint's, so ids stay unique over the run. Numbers go up by
    # `index_stride`: the processes of a multi-process run number their groups apart
    # (process p of n: p, p + n, ...), so that sessions on servers they share never meet.
    self.next_index = 0
    self.index_stride = 1
    self.groups: collections.OrderedDict[int, Group] = collections.OrderedDict()
    self.episode_slots = asyncio.Semaphore(cfg.max_concurrent_episodes)
    self.dropped: collections.Counter = collections.Counter()
    self.retries = 0
    self.replaced = 0  # groups dropped by the filters and replaced by fresh ones
    self._changed = asyncio.Event()
    self._producer: Optional[asyncio.Task] = None
    self._tasks: set[asyncio.Task] = set()
    self._stop = False
    self.error: Optional[BaseException] = None  # a bug an episode raised, or an outage
    self.error_task = None  # the task of the episode that raised it
    # The last infra_window episodes' outcomes: the infrastructure failure's kind that
    # dropped one after its retries, None for one that ended.
    self.outcomes: collections.deque = collections.deque(maxlen=max(1, cfg.infra_window))
    self.last_reason: dict[str, str] = {}  # each infrastructure kind's last episode's why
    self._over_since: Optional[float] = None  # when the drops went past the bound
    self._replaying: dict[int, object] = {}  # tasks being played again after infra drops
    self._finished: list[str] = []  # ids of groups consumed or dropped (drain_finished)

  # -- playing ---------------------------------------------------------------------------

  def _next_task(self):
    return self.requeue.popleft() if self.requeue else next(self.tasks)

  async def _episode(self, group: Group, i: int) -> Optional[Episode]:
    for attempt in range(self.cfg.max_retries + 1):
      sid = f"g{group.index}-{i}-r{attempt}"
      async with self.episode_slots:
        ep = await self.play(group.task, sid, f"g{group.index}")
      if not ep.infra_error:
        self._ended(None)
        return ep
      self.retries += attempt < self.cfg.max_retries
      if attempt < self.cfg.max_retries and self.cfg.retry_backoff_s > 0:
        await asyncio.sleep(min(self.cfg.retry_backoff_s * 2 ** attempt, 30.0))
    self.dropped["infra_error"] += 1
    self.dropped[f"infra_{ep.infra_kind or 'unknown'}"] += 1  # by the last attempt's kind
    self._ended(ep.infra_kind or "unknown", ep.reason)
    group.dropped_episodes += 1
    return None

  def _ended(self, infra_kind: Optional[str], reason: str = "") -> None:
    """Counts an episode's outcome, its retries done (one per episode: a policy that
    could make some of its episodes fail so does not weigh max_retries + 1 times);
    past `max_infra_fraction` of drops in a full window, spanning `infra_grace_s`, sets
    the outage that stops the run."""
    now = time.monotonic()
    self.outcomes.append(infra_kind)
    if infra_kind is not None:  # (the outage's message says the last of its main kind's)
      self.last_reason[infra_kind] = reason
    failed = [k for k in self.outcomes if k is not None]
    over = (len(self.outcomes) == self.outcomes.maxlen
            and len(failed) > self.cfg.max_infra_fraction * len(self.outcomes))
    if not over:
      self._over_since = None
    elif self._over_since is None:
      self._over_since = now  # past the bound from here on: for infra_grace_s, an outage
    if (self.error is None and over
        and now - self._over_since >= self.cfg.infra_grace_s):
      counts = collections.Counter(failed).most_common()
      kinds = ", ".join(f"{k} {n}" for k, n in counts)
      self.error = InfraOutage(
          f"{len(failed)} of the last {len(self.outcomes)} episodes failed in the "
          f"infrastructure, retries and all ({kinds}), more than rollout.max_infra_fraction "
          f"{self.cfg.max_infra_fraction}: {_OUTAGE_HINTS.get(counts[0][0], _OUTAGE_HINT)} "
          f"(their logs; dropped_infra_* in metrics.jsonl count the run's: this process "
          f"dropped {self.dropped['infra_error']} episodes so), then resume the run"
          + (f"; the last {counts[0][0]}: {self.last_reason[counts[0][0]][:300]}"
             if self.last_reason.get(counts[0][0]) else ""))
      self._changed.set()

  async def _run_group(self, group: Group) -> None:
    episodes = [asyncio.ensure_future(self._episode(group, i))
                for i in range(self.cfg.group_size)]
    try:
      results = await asyncio.gather(*episodes)
    except asyncio.CancelledError:  # (gather cancels the episodes)
      raise
    except Exception as e:  # a bug: the run stops with it (next_groups raises it)
      if isinstance(e, TaskError):  # the data's: not kept to be played on a resume
        self.groups.pop(group.index, None)
        self._finished.append(f"g{group.index}")
      if self.error is None:  # (the first: a later group's bug named another task)
        self.error, self.error_task = e, group.task
      self._changed.set()
      # The group's other episodes end with it: gather left them running, out of any
      # task `stop` cancels, on servers and workers the run then closed (a reviewer).
      for t in episodes:
        t.cancel()
      await asyncio.gather(*episodes, return_exceptions=True)
      return
    group.episodes = [e for e in results if e is not None]
    group.done = True
    self._changed.set()

  def _start_group(self) -> Group:
    group = Group(self.next_index, self._next_task(), started_version=self.served)
    self.started += 1
    self.next_index += self.index_stride
    self.groups[group.index] = group
    t = asyncio.create_task(self._run_group(group))
    group.task_handle = t
    self._tasks.add(t)
    t.add_done_callback(self._tasks.discard)
    return group

  # -- async production --------------------------------------------------------------------

  def _capacity(self) -> int:
    if self.cfg.mode == "sync":
      return 0
    # Groups the filters dropped were replaced, so they do not count against the bound.
    # With redundancy r, (1 + r) times the groups the bound lets through may run: the
    # first to finish are trained on, the rest go stale and are dropped (ROLL's
    # redundant rollouts: throughput against heavy-tailed environments, paid in work).
    # A group started on the served weights is accepted until the learner is
    # staleness_bound() versions past them, a step of groups_per_step groups a version
    # (max_staleness here, not the bound, let no group start between syncs when
    # sync_every - 1 is past it: the run waited for ever; red team 20).
    return (self.served * self.cfg.groups_per_step + groups_running(self.cfg)
            + self.replaced - self.shortfall)

  async def _produce(self) -> None:
    try:
      while not self._stop:
        running = sum(not g.done for g in self.groups.values())
        in_flight_cap = max(1, self.cfg.max_concurrent_episodes // self.cfg.group_size) * 2
        if self.started < self._capacity() and running < in_flight_cap:
          self._start_group()
          continue
        self._changed.clear()
        await self._changed.wait()
    except asyncio.CancelledError:
      raise
    except Exception as e:  # the run stops with it (the producer died in silence, and the
      # run waited for groups for ever: red team 15's nan redundancy; a bad task line)
      if self.error is None:  # (the data's, the run's storage, an outage: as they are)
        if isinstance(e, (TaskError, RunWriteFailed, InfraOutage)):
          self.error = e
        else:
          self.error = ProducerFailed(
              f"starting the next group failed: {type(e).__name__}: {e} (a bug)")
          self.error.__cause__ = e
      self._changed.set()

  def go_on_from(self, version: int, next_group: int, process: int = 0,
                 processes: int = 1) -> None:
    """Where a run goes on (a resume: its checkpoint's policy version and next group
    number; 0 and 0 for a new run), as process `process` of `processes`: groups are
    numbered from `next_group` on, this process's apart from the others' (p, p + n, ...),
    and the capacity rule counts the groups the run's earlier steps consumed as started
    (without them, a run resumed at version v would start v x groups_per_step groups
    beyond the bound, to go stale)."""
    self.index_stride = processes
    self.next_index = next_group + (process - next_group) % processes
    self.started = version * self.cfg.groups_per_step
    self.served = version
    self.set_version(version)

  def start(self) -> None:
    if self.cfg.mode != "sync" and self._producer is None:
      self._producer = asyncio.create_task(self._produce())

  def set_version(self, version: int) -> None:
    """The learner's version, after each step: staleness is measured against it (against
    the served weights' between syncs, groups staler than the bound were trained: red
    team 20)."""
    self.version = version
    if self.cfg.mode != "sync":
      self._drop_doomed()
    self._changed.set()

  def trained(self, groups: list[Group]) -> None:
    """A step trained on `groups` (one version)."""
    self.shortfall += max(0, self.cfg.groups_per_step - len(groups))

  def trained_nothing(self, groups: list[Group]) -> None:
    """A step's groups gave it nothing to train on (no version came of them): they are
    replaced, as groups the filters drop are (the capacity rule counted them as a step's:
    max_staleness + 1 such steps let no group start again in the async modes, and the
    run waited for ever; red team 20)."""
    self.replaced += len(groups)
    for g in groups:
      g.counted_as = "nothing_trained"
    self._changed.set()

  def set_served(self, version: int) -> None:
    """The version the servers now serve (a weight sync): the groups started from now
    on start on it."""
    self.served = version
    self._changed.set()

  def staleness_bound(self) -> int:
    """How many versions a group's oldest token may be behind `version`: in sync mode,
    none beyond what the learner runs ahead of the servers between weight updates
    (sync_every - 1; 0 when it updates them every step): an older token is a server that
    lost its weights (restarted); in the async modes max_staleness, and at least that. A
    run resumed from a checkpoint between two updates replays episodes of the last
    update's weights, within that bound."""
    return staleness_bound(self.cfg)

  def _drop_doomed(self) -> None:
    """Drops, at once, the groups the staleness bound can no longer accept: finished ones
    whose oldest token is too old, and running ones started on weights too old (their
    first turns ran on them; they are cancelled: engine requests aborted, environments
    closed). Each is replaced, so its capacity goes to a fresh group now instead of
    after it has run to the end and been consumed."""
    oldest = self.version - self.staleness_bound()
    for g in list(self.groups.values()):
      v = g.min_version() if g.done else g.started_version
      if v is None or v >= oldest:
        continue
      if not g.done and g.task_handle is not None:
        g.task_handle.cancel()
      self._replaying.pop(id(g.task), None)
      del self.groups[g.index]
      self._finished.append(f"g{g.index}")
      self.dropped["stale"] += 1
      self.replaced += 1

  async def stop(self) -> None:
    self._stop = True
    self._changed.set()
    for t in [self._producer, *self._tasks]:
      # (not a group `_drop_doomed` cancelled already: cancelled again, its episodes'
      # environment sessions were cut in their close, left open on the workers until
      # their idle reaper; a reviewer)
      if t is not None and not t.cancelling():
        t.cancel()
    await asyncio.gather(*[t for t in [self._producer, *self._tasks] if t is not None],
                         return_exceptions=True)

  # -- consumption -----------------------------------------------------------------------

  def _accept(self, group: Group) -> bool:
    why = self._refused(group)
    if why is not None:
      self.dropped[why] += 1
      group.counted_as = why
    return why is None

  def _refused(self, group: Group) -> Optional[str]:
    """Why the filters drop `group` (None: accepted)."""
    replay = self._replaying.pop(id(group.task), None) is not None
    if len(group.episodes) < 2:
      if not replay and group.dropped_episodes:
        # The infrastructure's drops left it short: its task is played again, once.
        self._replaying[id(group.task)] = group.task
        self.requeue.append(group.task)
        group.requeued = True
      return "too_few_valid"
    v = group.min_version()
    if v is not None and self.version - v > self.staleness_bound():
      return "stale"
    newest = group.max_version()
    if newest is not None and newest > self.version:
      # Weights this run has not made (a server still serving a stopped run's): the
      # versions would not say which weights sampled the tokens.
      return "future_version"
    if self.cfg.filter_equal_rewards and not carries_signal(group, self.advantage):
      return "no_signal"
    return None

  async def next_groups(self) -> tuple[list[Group], list[Group]]:
    """The next step's groups: (accepted, all finished groups consumed, for metrics).

    Groups the filters drop are replaced (dynamic sampling, as DAPO) until
    `groups_per_step` are accepted or `max_sample_rounds` x `groups_per_step` groups
    have been consumed, so batches keep their size as the policy converges.
    """
    n = self.cfg.groups_per_step
    accepted: list[Group] = []
    taken: list[Group] = []
    try:
      while len(accepted) < n and len(taken) < self.cfg.max_sample_rounds * n:
        self._raise_error()
        batch = await self._take(n - len(accepted))
        taken += batch
        ok = [g for g in batch if self._accept(g)]
        self.replaced += len(batch) - len(ok)
        accepted += ok
    except BaseException:  # (a run stopping, an outage): the groups taken are not lost
      self.give_back(taken)
      raise
    return accepted, taken

  def give_back(self, groups: list[Group]) -> None:
    """Groups taken since the last step that trained, given back as never taken at a
    stop: the accepted, those the filters dropped and those a step found nothing in,
    no longer counted as dropped or replaced. Saved as in flight, a resume plays them
    again from their episodes' logs and counts them once, in its first row; consumed by
    the final save, they were in no row of either run (a reviewer). A group whose task
    was re-queued (the infrastructure left it short) stays taken: the task's second play
    stands for it."""
    back = []
    for g in groups:
      if g.requeued:
        continue
      if g.counted_as is not None:
        self.replaced -= 1
        if g.counted_as in self.dropped:
          self.dropped[g.counted_as] -= 1
        g.counted_as = None
      back.append(g)
    self.put_back(back)

  def put_back(self, groups: list[Group]) -> None:
    """Groups taken by a step that was given up: in the scheduler again, in their order,
    as if never taken (saved with a checkpoint, their episodes' logs kept for a resume)."""
    if not groups:
      return
    back = {f"g{g.index}" for g in groups}
    self._finished = [i for i in self._finished if i not in back]
    merged = sorted([*self.groups.values(), *groups], key=lambda g: g.index)
    self.groups = collections.OrderedDict((g.index, g) for g in merged)
    self._changed.set()

  async def _take(self, n: int) -> list[Group]:
    """`n` finished groups: fresh ones on the current weights (sync), or the oldest ready."""
    if self.cfg.mode == "sync":
      fresh = [self._start_group() for _ in range(n)]
      while not all(g.done for g in fresh):
        self._raise_error()
        self._changed.clear()
        await self._changed.wait()
      taken = fresh
    else:
      while True:
        self._raise_error()
        order = list(self.groups.values())
        pool = order[:self.cfg.window] if self.cfg.mode == "window" else order
        ready = [g for g in pool if g.done]
        if len(ready) >= n:
          taken = ready[:n]
          break
        self._changed.clear()
        await self._changed.wait()
    for g in taken:
      self.groups.pop(g.index, None)
      self._finished.append(f"g{g.index}")
    self._changed.set()
    return taken

  def drain_finished(self) -> list[str]:
    """Ids of the groups consumed or dropped since the last call (their episodes are
    done with: a resumed run will not replay them)."""
    out, self._finished = self._finished, []
    return out

  def _raise_error(self) -> None:
    if isinstance(self.error, (InfraOutage, TaskError, RunWriteFailed, ProducerFailed)):
      raise self.error
    if isinstance(self.error, EpisodeBug):  # (named already: an environment's bad reward)
      raise self.error
    if self.error is not None:
      task = self.error_task
      if isinstance(task, dict):  # (a task re-queued from a checkpoint, as saved)
        task = types.SimpleNamespace(id=task.get("id"), env=task.get("env"))
      raise EpisodeBug(task, self.error) from self.error

  def pending_tasks(self) -> list:
    """Tasks started but not yet consumed (saved with a checkpoint, replayed on resume)."""
    return list(self.requeue) + [g.task for g in self.groups.values()]


# -- batcher ------------------------------------------------------------------------------


def episode_index(session_id: str) -> int:
  """The index in its group of the episode a scheduler session id names
  (`g<group>-<episode>-r<attempt>`)."""
  return int(session_id.split("-")[1])


@functools.cache
def _jit(fn, *static: str):
  """`fn` jitted with `static` keyword arguments (cached: one wrapper per estimator)."""
  import jax

  return jax.jit(fn, static_argnames=static)


ESTIMATORS = ("grpo", "rloo", "chunk", "opd")
BASELINES = ("group", "batch")


def carries_signal(group: Group, cfg: AdvantageConfig) -> bool:
  """Whether the group's advantages can be other than 0: its samples' rewards differ,
  or something outside the group sets them (a step-wide baseline, a teacher's per-token
  term). For the chunk estimator, its samples' returns from some turn two or more of
  them reached differ (equal totals of other turn rewards, or a faster success under a
  discount, still rank turns; a turn one sample alone reached takes its advantage at
  the last turn others reached, so other turn counts alone rank nothing)."""
  if cfg.baseline == "batch" or cfg.teacher:
    return True
  if cfg.estimator == "chunk":
    turns = [list(map(float, e.turn_rewards)) for e in group.episodes]
    for k in range(max(map(len, turns), default=0)):
      returns = [sum(cfg.gamma ** (j - k) * r for j, r in enumerate(t) if j >= k)
                 for t in turns if len(t) > k]
      if len(returns) < 2:
        break
      if not advantages.flat(returns):
        return True
    return False
  # (by the advantages' own rule: an absolute 1e-9 kept [1000, 1000.0009], whose
  # advantages are 0, and dropped [0, 1e-10], whose are +-1; red team 37)
  return not advantages.flat(group.rewards)


def step_signal(trained: list[Group], cfg: AdvantageConfig):
  """`signal(group)` for a step's metrics (`groups_with_signal`): whether the group's
  advantages in this step can be other than 0. As `carries_signal`, but with a
  step-wide baseline, only where the step's `trained` groups (this process's) differ as
  one group would (every group counted on every step whose rewards were all 0: a new
  user)."""
  if cfg.baseline == "batch" and not cfg.teacher:
    whole = Group(-1, None, episodes=[e for g in trained for e in g.episodes])
    differ = carries_signal(whole, dataclasses.replace(cfg, baseline="group"))
    return lambda group: differ
  return functools.partial(carries_signal, cfg=cfg)


def staleness_bound(cfg: RolloutConfig) -> int:
  """`RolloutScheduler.staleness_bound` of a run of `cfg`."""
  behind = cfg.sync_every - 1
  return behind if cfg.mode == "sync" else max(cfg.max_staleness, behind)


def groups_running(cfg: RolloutConfig) -> int:
  """The groups the staleness bound lets run on one version's weights (with
  `redundancy`, that many more again: `RolloutScheduler._capacity`)."""
  versions = staleness_bound(cfg) + 1
  return versions * cfg.groups_per_step + int(round(
      cfg.redundancy * versions * cfg.groups_per_step))


def rollout_notes(cfg: RolloutConfig) -> list[str]:
  """What a run is told of its rollout settings that are allowed but easy to mistake."""
  behind, notes = cfg.sync_every - 1, []
  if cfg.mode != "sync" and behind > cfg.max_staleness:
    notes.append(f"rollout.sync_every {cfg.sync_every}: the servers' weights are up to "
                 f"{behind} versions behind the learner's, so tokens that old are trained, "
                 f"past rollout.max_staleness ({cfg.max_staleness})")
  running = groups_running(cfg)
  if cfg.mode == "window" and cfg.window >= running:
    # (the defaults' 16 against 2 x 8: window mode measured as async, a reviewer)
    notes.append(f"rollout.window {cfg.window} holds every group the staleness bound lets "
                 f"run ({running}): a step takes the groups first done, as in async mode; "
                 f"a window below it waits for the oldest (rollout.groups_per_step "
                 f"{cfg.groups_per_step}: a first-in-first-out queue)")
  return notes


def check_advantage_config(cfg: AdvantageConfig) -> None:
  """Fails naming the key on an unknown estimator or baseline."""
  if cfg.estimator not in ESTIMATORS:
    raise ValueError(unknown_value("advantage.estimator", cfg.estimator, ESTIMATORS))
  if cfg.baseline not in BASELINES:
    raise ValueError(unknown_value("advantage.baseline", cfg.baseline, BASELINES))
  if cfg.estimator == "opd" and not cfg.teacher:
    raise ValueError("advantage.estimator opd needs advantage.teacher (a served model's name)")


def baseline_share(groups: list[Group], cfg: AdvantageConfig) -> Optional[list]:
  """What these episodes add to a step-wide baseline over several processes' episodes
  (`baseline: batch`; what `compute_advantages` gathers), or None."""
  if cfg.baseline != "batch":
    return None
  return [list(map(float, e.turn_rewards)) if cfg.estimator == "chunk" else float(e.reward)
          for g in groups for e in g.episodes]


def compute_advantages(groups: list[Group], cfg: AdvantageConfig,
                       gather: Optional[Callable[[Any], tuple[list, int]]] = None) -> None:
  """Sets `advantages` on every segment of the groups' episodes (host side).

  `gather(value) -> (every process's value, this process's index)`: with several
  processes and `baseline: batch`, the step's baseline is over every process's episodes
  (all processes must call it, each step)."""
  check_advantage_config(cfg)
  import jax.numpy as jnp

  from jaxagent import advantages as adv

  episodes = [e for g in groups for e in g.episodes]
  # With a step-wide baseline across processes: the other processes' episodes' rewards
  # join this one's (before and after them, in process order), and only this one's
  # advantages are kept.
  before: list = []
  after: list = []
  if cfg.baseline == "batch" and gather is not None:
    parts, me = gather(baseline_share(groups, cfg))
    before = [x for p in parts[:me] for x in p]
    after = [x for p in parts[me + 1:] for x in p]
  if not episodes:
    return
  gid = np.asarray([i for i, g in enumerate(groups) for _ in g.episodes], np.int32)
  num_groups = len(groups)
  if cfg.baseline == "batch":  # one group: the baseline (and std) of the whole step
    gid, num_groups = np.zeros(len(before) + len(episodes) + len(after), np.int32), 1
  mine = slice(len(before), len(before) + len(episodes))
  if cfg.estimator in ("grpo", "rloo"):
    r = np.asarray(before + [e.reward for e in episodes] + after, np.float32)
    if cfg.estimator == "grpo":
      a = _jit(adv.group_normalized, "num_groups", "scale_by_std")(
          jnp.asarray(r), jnp.asarray(gid), num_groups=num_groups,
          scale_by_std=cfg.scale_by_std)
    else:
      a = _jit(adv.rloo, "num_groups")(jnp.asarray(r), jnp.asarray(gid),
                                       num_groups=num_groups)
    values = np.asarray(a)[mine, None]
    per_turn = False
  elif cfg.estimator == "chunk":
    turns = before + [list(e.turn_rewards) for e in episodes] + after
    K = max(1, max(len(t) for t in turns))
    rewards = np.zeros((len(turns), K), np.float32)
    valid = np.zeros((len(turns), K), bool)
    for i, t in enumerate(turns):
      rewards[i, :len(t)] = t
      valid[i, :len(t)] = True
    values = np.asarray(_jit(adv.chunk_advantages, "gamma", "num_groups", "scale_by_std")(
        jnp.asarray(rewards), jnp.asarray(valid), gamma=cfg.gamma,
        group_ids_N=jnp.asarray(gid), num_groups=num_groups,
        scale_by_std=cfg.scale_by_std))[mine]
    per_turn = True
  elif cfg.estimator == "opd":  # the teacher's term alone
    values, per_turn = np.zeros((len(episodes), 1), np.float32), False
  else:  # unreachable: checked above
    raise AssertionError(cfg.estimator)
  if not np.isfinite(values).all():  # (rewards near float32's top, summed or spread)
    e = episodes[int(np.argwhere(~np.isfinite(values))[0, 0])]
    raise ValueError(f"the advantages of task {e.task_id!r}'s episode are not finite: its "
                     f"group's rewards or returns (its own: {e.reward!r}) pass float32's "
                     "range (the learner's, +-3.4e38) summed or spread; scale them down")
  for i, e in enumerate(episodes):
    for s in e.segments:
      turns = np.clip(s.turn_ids, 0, values.shape[1] - 1) if per_turn else np.zeros_like(
          s.turn_ids)
      s.advantages = (values[i, turns] * s.loss_mask).astype(np.float32)
      if cfg.teacher and s.num_action_tokens:  # (nothing sampled: nothing scored)
        if s.teacher_logp is None:
          raise ValueError(f"segment {s.segment_id} has no teacher log-probs "
                           f"(advantage.teacher {cfg.teacher!r} did not score it)")
        s.advantages = s.advantages + np.asarray(adv.distillation(
            jnp.asarray(s.teacher_logp), jnp.asarray(s.rollout_logp),
            jnp.asarray(s.loss_mask), cfg.opd_coef), np.float32)
        if not np.isfinite(s.advantages).all():  # (the learner's non-finite update
          # named its learning rate, not the teacher; a reviewer)
          at = int(np.argwhere(~np.isfinite(s.advantages))[0, 0])
          raise ValueError(
              f"the teacher {cfg.teacher!r} scored token {at} of task {e.task_id!r}'s "
              f"segment {s.segment_id} {s.teacher_logp[at]!r}: its log-probs must be "
              "finite (a teacher of another vocabulary or a broken scorer)")


def batch_rows(used_rows: int, max_rows: int, multiple: int = 1) -> int:
  """Rows for a batch whose segments fill `used_rows` rows: the smallest entry of
  `row_ladder(max_rows, multiple)` that holds them (few shapes, so few compiles)."""
  ladder = row_ladder(max_rows, multiple)
  return next((r for r in ladder if r >= used_rows), ladder[-1])


def _first_tokens(training: dict, n: int) -> dict:
  """A segment's training arrays cut to their first `n` tokens."""
  length = len(training["tokens"])
  if length <= n:
    return training
  return {k: v[:n] if isinstance(v, np.ndarray) and v.ndim and len(v) == length else v
          for k, v in training.items()}


def pack_groups(groups: list[Group], cfg: AdvantageConfig, rows: int, seq_len: int,
                pad_id: int, row_multiple: int = 1, with_ref: bool = False,
                gather: Optional[Callable[[Any], tuple[list, int]]] = None
                ) -> tuple[TrajectoryBatch, dict]:
  """This process's part of `make_batch`: advantages, then packing (first-fit decreasing)
  into the ladder's largest row count; `info["rows"]` is how many rows its segments fill
  (`trim_batch` cuts the batch to its shape). Nothing here meets the other processes but
  `gather` (see `compute_advantages`)."""
  compute_advantages(groups, cfg, gather)
  by_group = [[s for e in g.episodes for s in e.segments if s.num_action_tokens]
              for g in groups]
  # A segment longer than a row trains its first `seq_len` tokens (with its episode's
  # advantage). Dropped, a long failure would still lower its group's baseline while
  # never being pushed down itself: running long would hide a loss (red-team).
  too_long = [s for ss in by_group for s in ss if len(s) > seq_len]
  # (one whose first seq_len tokens hold no action trains nothing: it takes no row)
  by_group = [[s for s in ss if len(s) <= seq_len or s.loss_mask[:seq_len].any()]
              for ss in by_group]
  max_rows = row_ladder(rows, row_multiple)[-1]
  # What does not fit is left out by whole groups, the last ones: first-fit decreasing
  # leaves out the shortest segments, often a group's successes, whose rewards still
  # set their failures' baseline (red team 17: a step trained only the -1s).
  kept = _most_that_fit(by_group, max_rows, seq_len)
  segments = [s for ss in by_group[:kept] for s in ss]
  if kept == 0 and by_group:  # not even the first group: its first episodes (in their
    # order, not by length), rather than no step at all (a reviewer)
    trained = {id(s) for s in by_group[0]}
    first = [[s for s in e.segments if id(s) in trained] for e in groups[0].episodes]
    segments = [s for ss in first[:_most_that_fit(first, max_rows, seq_len)] for s in ss]
  batch, placed = pack([_first_tokens(s.to_training(), seq_len) for s in segments], max_rows,
                       seq_len, pad_id, decreasing=True, with_ref=with_ref)
  assert (placed >= 0).all()
  used_rows = int(placed.max()) + 1 if len(placed) else 1
  return batch, {"segments": len(segments), "too_long": len(too_long),
                 "episodes": len({s.session_id for s in segments}),
                 "overflow": sum(map(len, by_group)) - len(segments),
                 "overflow_groups": len(by_group) - max(kept, bool(segments)),
                 "used_segments": segments,
                 "rows": used_rows}


def _most_that_fit(units: list[list], rows: int, seq_len: int) -> int:
  """How many of `units` (lists of segments), in order, fit `rows` rows together."""
  if _fits([len(s) for u in units for s in u], rows, seq_len):
    return len(units)
  lo, hi = 0, len(units) - 1
  while lo < hi:
    mid = (lo + hi + 1) // 2
    if _fits([len(s) for u in units[:mid] for s in u], rows, seq_len):
      lo = mid
    else:
      hi = mid - 1
  return lo


def _fits(lengths: list[int], rows: int, seq_len: int) -> bool:
  """Whether segments of these lengths (each at most `seq_len`) all fit `rows` rows by
  first-fit decreasing, as `batch.pack` places them."""
  fill = np.zeros(rows, np.int64)
  for n in sorted((min(n, seq_len) for n in lengths), reverse=True):
    fits = np.nonzero(fill + n <= seq_len)[0]
    if not len(fits):
      return False
    fill[fits[0]] += n
  return True


def trim_batch(batch: TrajectoryBatch, info: dict, used_rows: int, rows: int,
               row_multiple: int = 1) -> tuple[TrajectoryBatch, dict]:
  """A packed batch cut to the smallest row count of the ladder that holds `used_rows`
  (its own `info["rows"]`, or every process's largest), with the fraction filled."""
  batch = take_rows(batch, batch_rows(used_rows, rows, row_multiple))
  return batch, {**info, "fill": float(np.mean(batch.segment_ids > 0))}


def make_batch(groups: list[Group], cfg: AdvantageConfig, rows: int, seq_len: int,
               pad_id: int, row_multiple: int = 1,
               agree_rows: Optional[Callable[[int], int]] = None, with_ref: bool = False,
               gather: Optional[Callable[[Any], tuple[list, int]]] = None
               ) -> tuple[TrajectoryBatch, dict]:
  """Advantages, then packing (first-fit decreasing) into at most `rows` x `seq_len`,
  trimmed to the smallest row count of the ladder that holds what was packed (a
  multiple of `row_multiple`: the learner's batch shards x microbatches); reports what
  did not fit (`overflow`), the segments cut to `seq_len` (`too_long`) and the fraction
  of token slots filled. `agree_rows` maps this
  packing's rows to the rows every process of a multi-process run uses (the max);
  `with_ref`: the batch carries `ref_logp` (scored by a served reference); `gather`:
  see `compute_advantages`."""
  batch, info = pack_groups(groups, cfg, rows, seq_len, pad_id, row_multiple, with_ref,
                            gather)
  used_rows = info["rows"] if agree_rows is None else agree_rows(info["rows"])
  return trim_batch(batch, info, used_rows, rows, row_multiple)


def no_step_warning(waited: float, played: Sequence, dropped: collections.Counter,
                    info: dict) -> str:
  """The line a run prints while it plays groups but trains none: for how long, how many
  groups (`played`, with their episodes), and why each was kept out (`dropped`: the
  scheduler's drop counts since the last step; `info`: the last packing's, its segments
  too long or past the rows). Where every episode scored alike it says the tasks are out
  of the policy's reach (a new user waited 15 minutes on such a run without a word)."""
  episodes = [e for g in played for e in g.episodes]
  unfit = [e for e in episodes if e.reason == FIRST_PROMPT_TOO_LONG]
  why = [f"{k} {v}" for k, v in dropped.most_common()]
  if unfit:
    why.append(f"{len(unfit)} episodes whose first prompt did not fit")
  if info.get("too_long"):
    why.append(f"{info['too_long']} segments longer than data.seq_len")
  if info.get("overflow"):
    why.append(f"{info['overflow']} segments data.rows could not hold")
  scores = {round(e.reward, 6) for e in episodes if not e.infra_error}
  alike = ""
  if dropped.get("no_signal") and len(scores) == 1:
    alike = (f"; every episode played scored {scores.pop():g}, so no group ranks "
             "its samples: the tasks are out of the policy's reach (easier tasks, "
             "a stronger starting policy, or process rewards give it a signal)")
  return (f"warning: no step for {waited:.0f} s: {len(played)} groups played, nothing "
          f"to train on ({', '.join(why) or 'no episode with a turn'}); no_signal is a "
          "group whose episodes all scored alike (rollout.filter_equal_rewards), "
          f"too_few_valid one whose episodes failed{alike}")
