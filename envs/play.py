"""`python -m envs.play`: play one task by hand or from a file of actions.

Prints each observation, the verdict and the exact per-turn rewards the learner
would train on (`envs.base.trained_rewards`): the tool to debug an environment
or a reward, and the one tests use.

  python -m envs.play --task-file envs/tasks/python_tests.jsonl --task-id python_tests/add
  python -m envs.play --task-file T.jsonl --task-id ID --actions actions.jsonl --json
  echo '"8"' | python -m envs.play --task-file envs/tasks/guess_number.jsonl \
      --task-id guess_number/0-0 --actions - --json

Without `--actions` each line typed is one action (`\\n` for a newline; with `--raw`
as typed, as a tool call's JSON wants its `\\n` and `\\\\` escapes). An
actions file is JSONL: each line a JSON string (the model's whole reply for the
turn) or `{"action": "..."}`. With `--json` every event is one JSON object per
line; the last is `{"verdict": ..., "reward": ..., "turn_rewards": [...]}`
(`reward` and `turn_rewards` are null for an `infra_error` verdict: the learner
retries or drops such an episode, it never scores it). `--server URL` plays
against an `envs.server` worker instead of in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import difflib
import inspect
import json
import os
import signal
import sys
import time
from typing import Callable, Iterable, Optional

from envs.base import (BAD_TASK, CannotStart, EnvResources, Observation, StepResult,
                       TaskSpec, Verdict, VerdictStatus, add_import_flag, cannot_start,
                       failure, load_modules, load_tasks, make, trained_rewards)
from jaxagent import control
from jaxagent.errors import InfraError


def read_actions(lines: Iterable[str]) -> list[str]:
  """Actions from JSONL lines (a JSON string, or an object with "action")."""
  actions = []
  for n, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      item = json.loads(line)
    except json.JSONDecodeError as e:
      # (`e.msg` alone read "Invalid control character at", cut before its column)
      at = e.msg if e.msg.endswith(" at") else f"{e.msg} at"
      raise ValueError(f"actions line {n}: not JSON ({at} column {e.colno}); write each "
                       "action as a JSON string") from None
    if isinstance(item, dict):
      item = item.get("action")
    if not isinstance(item, str):
      raise ValueError(f"actions line {n}: expected a JSON string or {{\"action\": \"...\"}}")
    actions.append(item)
  return actions


async def _within(call, deadline_s: Optional[float], what: str):
  """`call`'s result; InfraError `env_call_deadline` past `deadline_s` seconds (None:
  no bound), as a run's agent bounds each call (`agent.env_call_deadline_s`)."""
  if deadline_s is None:
    return await call
  try:
    return await asyncio.wait_for(call, deadline_s)
  except asyncio.TimeoutError:
    raise InfraError("env_call_deadline", f"the environment's {what} ran past {deadline_s:g} s "
                     "(--deadline-s; a run's agent.env_call_deadline_s): a tool or grader "
                     "that hangs") from None


async def play_episode(env, task: TaskSpec, next_action: Callable[[int], Optional[str]],
                       emit: Callable[[dict], None] = lambda event: None,
                       deadline_s: Optional[float] = None) -> dict:
  """Plays `task` on `env`, taking each turn's action from `next_action(turn)` (None: no
  more actions), and reports every event to `emit`. Returns the final event: the verdict
  and the rewards the learner would train on. The environment is closed at the end.
  Each call of the environment past `deadline_s` raises InfraError."""
  try:
    try:
      obs = await _within(env.reset(task), deadline_s, "reset")
    except CannotStart:  # a worker's refusal says so already
      raise
    except BAD_TASK as e:  # the task's parameters (or a bug of the environment's reset)
      raise cannot_start(task, e) from None
    _returned(env, "reset", obs, Observation)
    emit({"event": "reset", "task": task.id, "observation": dataclasses.asdict(obs)})
    step_rewards = []
    done = False
    turn = 0
    while not done:
      action = next_action(turn)
      if action is None:
        break
      step = _returned(env, "step", await _within(env.step(action), deadline_s, "step"),
                       StepResult)
      step_rewards.append(float(step.reward))
      done = step.terminated or step.truncated
      emit({"event": "step", "turn": turn, "action": action,
            "observation": dataclasses.asdict(step.observation), "reward": step.reward,
            "terminated": step.terminated, "truncated": step.truncated, "info": step.info})
      turn += 1
    t0 = time.perf_counter()
    verdict = _returned(env, "verify", await _within(env.verify(), deadline_s, "verify"),
                        Verdict)
    verify_s = time.perf_counter() - t0
  finally:
    await env.close()
  infra = verdict.status == VerdictStatus.INFRA_ERROR
  rewards = None if infra else trained_rewards(step_rewards, verdict)
  final = {"verdict": verdict.to_dict(), "reward": None if infra else sum(rewards),
           "turn_rewards": rewards, "finished": done, "verify_s": verify_s}
  emit(final)
  return final


class WrongReturn(TypeError):
  """An environment's method returned the wrong type (the message says where it is)."""


def _returned(env, method: str, value, kind: type):
  """`value` if it is what `env.method` must return; a `WrongReturn` naming the method
  (where it is defined) if not."""
  if not isinstance(value, kind):
    where = ""
    with contextlib.suppress(TypeError, OSError):
      fn = getattr(type(env), method)
      where = f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}: "
    article = "an" if kind.__name__[0].lower() in "aeiou" else "a"
    raise WrongReturn(f"{where}{type(env).__name__}.{method}() returned "
                      f"{type(value).__name__}, not {article} {kind.__name__}")
  return value


def _print_event(event: dict) -> None:
  if event.get("event") == "reset":
    print(f"== task {event['task']}")
    for m in event["observation"]["messages"]:
      print(f"[{m['role']}] {m.get('content')}")
    for t in event["observation"].get("tools") or []:
      print(f"[tool available] {t['function']['name']}: {t['function'].get('description', '')}")
  elif event.get("event") == "step":
    print(f"-- turn {event['turn']}: action {event['action']!r}")
    for m in event["observation"]["messages"]:
      print(f"[{m['role']}] {m.get('content')}")
    end = " (terminated)" if event["terminated"] else " (truncated)" if event["truncated"] else ""
    print(f"   step reward {event['reward']}{end}")
  else:
    v = event["verdict"]
    print(f"== verdict {v['status']} (verdict reward {v['reward']}, verifier "
          f"{v['verifier_version']}, {event['verify_s']:.2f}s)")
    reason = v.get("details", {}).get("reason")
    if reason:
      print(f"   {reason}")
    if event["turn_rewards"] is None:
      print("   infra_error: the learner retries or drops this episode; it is never scored")
    else:
      print(f"   the learner trains on reward {event['reward']} (per turn "
            f"{event['turn_rewards']})")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m envs.play", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--task-file", required=True, help="JSONL task file")
  p.add_argument("--task-id", help="which task (default: the file's first)")
  p.add_argument("--actions", help="JSONL file of actions, or - for stdin (default: type them)")
  p.add_argument("--json", action="store_true", help="one JSON object per event")
  p.add_argument("--raw", action="store_true",
                 help="take each typed line as it is (\\n stays two characters: a tool "
                      "call's JSON escapes); without it \\n is a newline")
  p.add_argument("--server", help="an envs.server worker URL (default: in this process); "
                                  "its calls carry JAXAGENT_ENV_TOKEN where it is set")
  p.add_argument("--sandboxes", type=int, default=2)
  p.add_argument("--deadline-s", type=float, default=60.0,
                 help="each reset, step and verify ends past it in wall time (a run's "
                      "agent.env_call_deadline_s bounds the call's own time, its waits "
                      "for sandbox slots and the policy's commands left out); default "
                      "60, 0: no bound")
  p.add_argument("--allow-unisolated", action="store_true",
                 help="run tool code without isolation where the host has none")
  add_import_flag(p)
  args = p.parse_args(argv)
  if not args.deadline_s >= 0:
    p.error(f"--deadline-s must be >= 0 (0: no bound), got {args.deadline_s}")
  problem = control.env_problem()
  if problem:
    print(f"error: {problem}", file=sys.stderr)
    return 2
  try:
    try:
      load_modules(args.imports)
    except ValueError as e:
      raise ValueError(f"--import {e}") from None
    tasks = load_tasks(args.task_file)
    by_id = {t.id: t for t in tasks}
    if not tasks:
      raise ValueError(f"{args.task_file} has no tasks")
    if args.task_id is not None and args.task_id not in by_id:
      # (compared past the ids' common prefix: every python_tests id was near any other)
      cut = len(os.path.commonprefix([args.task_id, *by_id]))
      close = set(difflib.get_close_matches(args.task_id[cut:], [i[cut:] for i in by_id], n=3))
      near = [i for i in by_id if i[cut:] in close][:3]
      raise ValueError(f"no task {args.task_id!r} in {args.task_file}"
                       + (f"; did you mean {' or '.join(map(repr, near))}?" if near else
                          f" (its {len(tasks)} tasks' ids: {', '.join(list(by_id)[:5])}"
                          + (", ...)" if len(by_id) > 5 else ")")))
    task = by_id[args.task_id] if args.task_id else tasks[0]
    scripted = None
    if args.actions == "-":
      scripted = read_actions(sys.stdin)
    elif args.actions:
      with open(args.actions) as f:
        scripted = read_actions(f)
  except (OSError, ValueError) as e:
    print(f"envs.play: {e}", file=sys.stderr)
    return 2

  def next_action(turn: int) -> Optional[str]:
    if scripted is not None:
      return scripted[turn] if turn < len(scripted) else None
    if sys.stdin.isatty():
      try:
        line = input("action> ")
      except EOFError:
        return None
    else:  # (piped: no prompt in the output, which --json keeps to JSON lines)
      line = sys.stdin.readline()
      if not line:
        return None
      line = line.removesuffix("\n")
    return line if args.raw else line.replace("\\n", "\n")

  emit = (lambda e: print(json.dumps(e), flush=True)) if args.json else _print_event
  resources = None
  if args.server:
    from envs.server import RemoteEnv
    env = RemoteEnv(args.server)
  else:
    resources = EnvResources(sandboxes=args.sandboxes, allow_unisolated=args.allow_unisolated)
    try:
      env = make(task.env, resources)
    except Exception as e:  # unknown environment, no isolation: say so, no traceback
      said = e.args[0] if isinstance(e, KeyError) and e.args else f"{type(e).__name__}: {e}"
      print(f"envs.play: {said}", file=sys.stderr)
      resources.close()
      return 2
  # Ctrl-C raises where the episode waits, in `input()` too (asyncio.run's own handler
  # only cancels the episode's task, which the blocked read did not see: the first
  # Ctrl-C was lost, the second a traceback). The episode's task is cancelled on the way
  # out, and its environment closed.
  previous = signal.signal(signal.SIGINT, _interrupt)
  try:
    asyncio.run(play_episode(env, task, next_action, emit, args.deadline_s or None))
  except KeyboardInterrupt:
    print("\ninterrupted: the episode was not verified", file=sys.stderr)
    return 130
  except (CannotStart, WrongReturn) as e:  # (its message says where already)
    print(f"envs.play: {e}", file=sys.stderr)
    return 2
  except InfraError as e:  # raised, as a returned infra_error verdict is said
    said = e if e.kind == "env_call_deadline" else failure(e)  # (play's own, or where)
    print(f"envs.play: the infrastructure failed: {said}: a run retries or drops this "
          "episode; it is never scored", file=sys.stderr)
    return 3
  except Exception as e:  # an environment's bug: where it was raised, no traceback (a
    # worker's refusal names its own line: not play's, nor its client class's)
    print(f"envs.play: {e if getattr(e, 'on_worker', False) else failure(e)}",
          file=sys.stderr)
    return 2
  finally:
    signal.signal(signal.SIGINT, previous)
    if resources is not None:
      resources.close()
  return 0


def _interrupt(signum, frame):
  raise KeyboardInterrupt


if __name__ == "__main__":
  from jaxagent.pools import end_process

  end_process(main(), "envs.play")
