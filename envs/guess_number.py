"""`guess_number`: find a hidden number in a range from higher/lower feedback.

The verdict pays 1 for the right number within the turn budget (the terminal
reward, `envs.base.trained_rewards`). An optional process reward per turn (`process_reward`, a scale) pays for information: the
fraction of the numbers still possible that the guess rules out (about half
for a bisecting guess, all of them for the right one, none for a guess the
feedback had already excluded). With `information: expected` it pays the
expected fraction over the numbers still possible instead of the fraction this
secret happened to give: a grade of the move itself, free of the luck of the
draw (the realized fraction rewards a guess next to the secret more than a
bisecting one). `feedback: range` restates the range still possible after
"Higher"/"Lower". Messages are short so a tiny byte-level model can learn the
game from scratch.
"""

from __future__ import annotations

import random
import re

from envs.base import (Env, Observation, StepResult, TaskSpec, Verdict, VerdictStatus, register,
                       task_int, task_known, task_number, task_text)

_INT = re.compile(r"-?\d+")


KNOWN_PARAMS = {"low", "high", "secret", "seed", "max_turns", "process_reward", "feedback",
                "information", "prompt"}


@register("guess_number")
class GuessNumber(Env):
  version = "2"  # 2: the terminal reward moved from the last step into the verdict
  verifier_version = "1"

  async def reset(self, task: TaskSpec) -> Observation:
    p = task.params
    self.task = task
    self.low, self.high = task_int(p, "low", 1, task.id), task_int(p, "high", 16, task.id)
    if self.low > self.high:
      raise ValueError(f"task {task.id}: low ({self.low}) > high ({self.high})")
    if max(abs(self.low), abs(self.high)) >= 10**18:  # (a guess of 19 digits is not read)
      raise ValueError(f"task {task.id}: low and high must be within +-10^18 (a guess that "
                       "long is answered as too long)")
    self.max_turns = task_int(p, "max_turns", 5, task.id)
    self.process_reward = task_number(p, "process_reward", 0.0, task.id)
    seed = p.get("seed", task.id)
    self.secret = task_int(p, "secret", 0, task.id) if "secret" in p else random.Random(str(seed)).randint(
        self.low, self.high)
    if not self.low <= self.secret <= self.high:  # (it would be played as a plain failure)
      raise ValueError(f"task {task.id}: secret {self.secret} is outside {self.low}..{self.high}")
    task_known(p, KNOWN_PARAMS, task.id)
    self.lo, self.hi = self.low, self.high  # what the feedback still allows
    self.turns, self.done, self.solved = 0, False, False
    self.reset_counters()
    self.guesses: list[int] = []
    self.feedback = p.get("feedback", "plain")
    if self.feedback not in ("plain", "range"):
      raise ValueError(f"task {task.id}: feedback must be 'plain' or 'range', got "
                       f"{self.feedback!r}")
    self.information = p.get("information", "realized")
    if self.information not in ("realized", "expected"):
      raise ValueError(f"task {task.id}: information must be 'realized' or 'expected', got "
                       f"{self.information!r}")
    prompt = task_text(p.get("prompt", "Guess my number, {low} to {high}."), "prompt",
                       task.id, low=self.low, high=self.high)
    return Observation([{"role": "user", "content": prompt}])

  async def step(self, action: str) -> StepResult:
    self.begin_turn()
    m = _INT.search(action)
    reward = 0.0
    if m is None:
      feedback, valid = "Say a number.", False
    elif len(m.group().lstrip("-")) > 18:  # (int() refuses 4,300+ digits; reset keeps ranges
      # within 18)
      feedback, valid = "That number is too long.", False
    else:
      guess = int(m.group())
      valid = True
      self.guesses.append(guess)
      before = max(self.hi - self.lo + 1, 1)
      expected = expected_information(self.lo, self.hi, guess)
      if guess == self.secret:
        self.solved = True
        feedback = "Correct!"
      elif guess < self.secret:
        feedback = "Higher."
        self.lo = max(self.lo, guess + 1)
      else:
        feedback = "Lower."
        self.hi = min(self.hi, guess - 1)
      after = 0 if self.solved else max(self.hi - self.lo + 1, 0)
      if self.feedback == "range" and not self.solved:
        feedback = f"{feedback[:-1]}: {self.lo}-{self.hi}."
      info = expected if self.information == "expected" else (before - after) / before
      reward += self.process_reward * info
    terminated = self.solved
    truncated = not terminated and self.turns >= self.max_turns
    self.done = terminated or truncated
    info = self._info(valid_action=valid, solved=self.solved)
    if truncated:
      info["truncation"] = "turn_budget"
    return StepResult(Observation([{"role": "user", "content": feedback}]), reward, terminated,
                      truncated, info)

  def state(self) -> dict:
    return {**super().state(), "secret": self.secret, "range": [self.lo, self.hi],
            "solved": self.solved}

  async def verify(self) -> Verdict:
    ok = self.solved
    return Verdict(VerdictStatus.PASS if ok else VerdictStatus.FAIL, 1.0 if ok else 0.0,
                   f"{self.name}@{self.version}", f"{self.name}@{self.verifier_version}",
                   {"secret": self.secret, "guesses": self.guesses, "turns": self.turns})

  def reference_action(self) -> str:
    """A perfect player: bisect what the feedback still allows."""
    return str((self.lo + self.hi) // 2)


def expected_information(lo: int, hi: int, guess: int) -> float:
  """Expected fraction of the numbers lo..hi that `guess` rules out, the secret uniform
  among them: 1 if it is the secret, else the side the feedback excludes plus the guess."""
  n = hi - lo + 1
  if n < 1 or not lo <= guess <= hi:
    return 0.0
  below, above = guess - lo, hi - guess  # secrets under / over the guess
  # Secret below: "Lower" rules out the guess and everything above it (n - below);
  # secret above: "Higher" rules out the guess and everything below it (n - above).
  return (below * (n - below) + above * (n - above) + n) / (n * n)


def make_tasks(n: int, *, low: int = 1, high: int = 16, max_turns: int = 5, seed: int = 0,
               process_reward: float = 0.0, **options) -> list[TaskSpec]:
  """`n` tasks with secrets drawn by `seed`; `options` (information, feedback, prompt) go
  into every task's params."""
  rng = random.Random(seed)
  return [TaskSpec(f"guess_number/{seed}-{i}", "guess_number",
                   {"low": low, "high": high, "max_turns": max_turns,
                    "secret": rng.randint(low, high), "process_reward": process_reward,
                    **options})
          for i in range(n)]


if __name__ == "__main__":  # writes a task file (configs/tiny.yaml's: --out envs/tasks/guess_number.jsonl)
  import sys

  from envs.base import task_file_parser, write_task_file

  ap = task_file_parser("python -m envs.guess_number", "guess_number")
  ap.add_argument("--process-reward", type=float, default=1.0,
                  help="the scale of each turn's process reward (0: none)")
  ap.add_argument("--information", default="expected", choices=["realized", "expected"],
                  help="a guess paid for the fraction it was expected to rule out, or did")
  ap.add_argument("--feedback", default="range", choices=["plain", "range"],
                  help="higher/lower alone, or with the range still possible")
  a = ap.parse_args()
  sys.exit(write_task_file(ap.prog, a.out, make_tasks(
      a.n, seed=a.seed, process_reward=a.process_reward, information=a.information,
      feedback=a.feedback)))
