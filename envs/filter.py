"""`python -m envs.filter TASKS.jsonl [--out KEPT.jsonl]`: keep only gradeable tasks.

Each task is played with scripted agents: the reference policy
(`Env.reference_action`) must pass, and the no-op agent (empty replies) and the
environment's shortcuts (`Env.shortcuts`: an own python_tests task's constant
answers, its first argument given back) must not. A task that fails any check is
dropped, with the reason reported; a grader infrastructure error is reported as such,
not as a bad task.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Callable, Optional

from envs.base import (BAD_TASK, CannotStart, EnvResources, StepResult, TaskSpec, Verdict,
                       VerdictStatus, add_import_flag, cannot_start, load_modules, load_tasks,
                       make, write_tasks)


# The turns a scripted play of a task may take before its task is dropped.
MAX_TURNS = 256


class NeverEnds(Exception):
  """A scripted play ran past MAX_TURNS: the task is dropped, saying so."""


async def play(task: TaskSpec, policy: Callable, resources: EnvResources,
               shortcuts: Optional[dict] = None) -> Verdict:
  """`task` played by `policy` (env -> action) to its verdict; `shortcuts`, given, gets
  the environment's (`Env.shortcuts`) once it is reset."""
  env = make(task.env, resources)
  try:
    try:
      await env.reset(task)
      if shortcuts is not None:  # (an environment's bug there is its task's failure to start)
        shortcuts.update(env.shortcuts())
    except BAD_TASK as e:
      raise cannot_start(task, e) from e
    for _ in range(MAX_TURNS):  # (as the agents do: by the step's result, an
      # environment's own `done` unset by one written as the docs say hung this for ever)
      if env.done:  # (over at its reset)
        return await env.verify()
      result = await env.step(policy(env))
      if not isinstance(result, StepResult):
        raise TypeError(f"environment {task.env!r}: step() returned "
                        f"{type(result).__name__}, not a StepResult")
      if result.terminated or result.truncated:
        return await env.verify()
    raise NeverEnds(f"a scripted play did not end within {MAX_TURNS} turns (no step's "
                    "result said terminated or truncated)")
  finally:
    await env.close()


async def _shortcuts_passing(task: TaskSpec, shortcuts: dict,
                             resources: EnvResources) -> list[str]:
  """Those of the environment's `shortcuts` of `task` that pass, each played."""
  passed = []
  for what, actions in shortcuts.items():
    script = iter(actions)
    if (await play(task, lambda env: next(script, ""), resources)).status == \
        VerdictStatus.PASS:
      passed.append(what)
  return passed


async def check(task: TaskSpec, resources: EnvResources) -> dict:
  """Whether `task` is kept, and why not. An environment (or task) without a reference
  policy is checked by the no-op agent alone, said in `note` (it was a traceback)."""
  note = None
  try:
    try:
      ref = await play(task, lambda env: env.reference_action(), resources)
    except NotImplementedError as e:
      ref, note = None, f"no reference: {e or 'no reference_action'}; the no-op check only"
    shortcuts: dict = {}
    noop = await play(task, lambda env: "", resources, shortcuts)
  except NeverEnds as e:
    return {"id": task.id, "keep": False, "reasons": [str(e)], "reference": "-",
            "noop": "-"}
  except CannotStart as e:  # dropped with its reason (it was a traceback)
    return {"id": task.id, "keep": False, "reasons": [f"cannot start: {e.why}"],
            "reference": "-", "noop": "-"}
  reasons = []
  passed = await _shortcuts_passing(task, shortcuts, resources)
  if passed:
    reasons.append(f"an answer that knows nothing passes: {passed[0]}")
  infra = [v for v in (ref, noop) if v is not None and v.is_infra_error]
  if infra:
    reasons.append("grader infrastructure error: " + json.dumps(infra[0].details.get("reason")))
  if ref is not None and ref.status != VerdictStatus.PASS and not ref.is_infra_error:
    reasons.append(f"reference solution does not pass ({ref.status.value})")
  if noop.status == VerdictStatus.PASS:
    reasons.append("no-op solution passes")
  out = {"id": task.id, "keep": not reasons, "reasons": reasons,
         "reference": ref.status.value if ref is not None else "-", "noop": noop.status.value}
  if note:
    out["note"] = note
  return out


async def filter_tasks(tasks: list[TaskSpec], resources: EnvResources,
                       concurrency: int = 4) -> list[dict]:
  sem = asyncio.Semaphore(concurrency)

  async def one(t):
    async with sem:
      return await check(t, resources)

  return await asyncio.gather(*(one(t) for t in tasks))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m envs.filter", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("tasks")
  p.add_argument("--out", default=None, help="write the kept tasks here (JSONL)")
  p.add_argument("--concurrency", type=int, default=4)
  add_import_flag(p)
  args = p.parse_args(argv)
  if args.concurrency < 1:
    print(f"error: --concurrency must be >= 1, got {args.concurrency}", file=sys.stderr)
    return 2
  try:
    load_modules(args.imports)
  except ValueError as e:
    print(f"error: --import {e}", file=sys.stderr)
    return 2
  try:
    tasks = load_tasks(args.tasks)
  except (OSError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  out_dir = os.path.dirname(os.path.abspath(args.out)) if args.out else None
  if out_dir is not None and not (os.path.isdir(out_dir) and os.access(out_dir, os.W_OK)):
    print(f"error: --out: cannot write in {out_dir} (no such directory, or not writable)",
          file=sys.stderr)  # (found before the work, not after it)
    return 2
  resources = EnvResources(sandboxes=args.concurrency * 2)
  try:
    reports = asyncio.run(filter_tasks(tasks, resources, args.concurrency))
  except KeyError as e:  # a task of an environment nobody registered
    print(f"error: {args.tasks}: {e.args[0] if e.args else e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:  # (Ctrl-C: its checks cancelled, nothing written)
    print("interrupted: nothing written", file=sys.stderr)
    return 130
  finally:
    resources.close()
  for r in reports:
    status = "keep" if r["keep"] else "DROP"
    print(f"{status} {r['id']}: reference {r['reference']}, no-op {r['noop']}"
          + (f" -- {'; '.join(r['reasons'])}" if r["reasons"] else "")
          + (f" ({r['note']})" if r.get("note") else ""))
  kept = [t for t, r in zip(tasks, reports) if r["keep"]]
  print(f"{len(kept)} of {len(tasks)} tasks kept")
  if args.out:
    write_tasks(args.out, kept)
  return 0


if __name__ == "__main__":
  from jaxagent.pools import end_process

  end_process(main(), "envs.filter")
