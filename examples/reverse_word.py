"""An environment of your own, whole: `reverse_word` asks for a word written backwards.

Run it with the tiny model (from the repository root):

  python -m jaxagent.train --config configs/tiny.yaml \
      'env.imports=[examples/reverse_word.py]' data.tasks=examples/reverse_word.jsonl \
      agent.max_new_tokens=12 agent.max_turns=2

(The nano model starts from random weights and cannot spell: in 800 steps its mean reward
rose from 0.000 to about 0.04 with no word right. The example shows the plumbing; a
pretrained model is what learns such a task.)

`env.imports` names the module (a .py file, or a module name on the path) that registers
it; `python -m envs.play --import examples/reverse_word.py --task-file
examples/reverse_word.jsonl` plays it by hand, and `envs.server` / `envs.filter` take the
same `--import`. docs/environments.md says what each method must do.
"""

from envs.base import (Env, Observation, StepResult, TaskSpec, Verdict, VerdictStatus, register,
                       task_int, task_known)


@register("reverse_word")  # the name task files give in their "env" field
class ReverseWord(Env):
  # Change `version` when what the policy sees changes, `verifier_version` when the
  # grading does: both are recorded with every trajectory.
  version = "1"
  verifier_version = "1"

  async def reset(self, task: TaskSpec) -> Observation:
    # A bad parameter raises ValueError, TypeError or KeyError: the task's fault, named;
    # one it does not know too (a misspelt `max_turn` was played at the default).
    task_known(task.params, ("word", "max_turns"), task.id)
    word = task.params["word"]
    if not isinstance(word, str) or not word:
      raise ValueError(f"task {task.id}: word must be a non-empty string")
    self.task, self.word, self.replies = task, word, []
    self.max_turns = task_int(task.params, "max_turns", 2, task.id)  # (a clear error for 2.5)
    self.turns, self.done = 0, False
    self.reset_counters()
    return Observation([{"role": "user", "content": f"Write '{word}' backwards."}])

  async def step(self, action: str) -> StepResult:
    # `action` is the model's text for the turn. Every turn may earn a process reward;
    # the outcome reward belongs to `verify`, which the learner adds to the last turn.
    self.begin_turn()
    reply = action.strip().strip("'\"")
    self.replies.append(reply)
    terminated = reply == self.word[::-1]
    truncated = not terminated and self.turns >= self.max_turns
    self.done = terminated or truncated
    feedback = [] if self.done else [{"role": "user", "content": "No. Try again."}]
    return StepResult(Observation(feedback), 0.0, terminated, truncated, self._info())

  async def verify(self) -> Verdict:
    # Grades what happened, never what the policy says happened. Raise nothing for a
    # wrong answer (that is a FAIL); an infrastructure failure is VerdictStatus.INFRA_ERROR.
    # A wrong last reply earns half a point for each letter in its place, so that a model
    # that starts from nothing finds a slope to climb; only the whole word passes.
    target, last = self.word[::-1], self.replies[-1] if self.replies else ""
    placed = sum(a == b for a, b in zip(last, target)) / max(len(last), len(target))
    ok = last == target
    return Verdict(VerdictStatus.PASS if ok else VerdictStatus.FAIL, 1.0 if ok else 0.5 * placed,
                   f"{self.name}@{self.version}", f"{self.name}@{self.verifier_version}",
                   {"word": self.word, "replies": self.replies})

  def state(self) -> dict:
    # What the next answers depend on besides the task: hashed into the token
    # write-ahead log, so a resumed run can check its replay.
    return {**super().state(), "replies": self.replies}

  def reference_action(self) -> str:  # what a perfect agent says (envs.filter uses it)
    return self.word[::-1]
