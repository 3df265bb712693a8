"""`calculator`: arithmetic word tasks with a `calculate` tool.

The model may call `calculate(expression)` (evaluated safely: numbers,
+ - * / // % ** and parentheses, bounded sizes) and ends with
`ANSWER: <number>`. The verdict pays 1 for the right final answer (steps pay
no process reward).
"""

from __future__ import annotations

import ast
import operator
import random
import re

from envs.base import (Env, Observation, StepResult, TaskSpec, Verdict, VerdictStatus, register)
from envs.tools import Tool, ToolSet

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
        ast.Pow: operator.pow}
_ANSWER = re.compile(r"ANSWER:\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
SYSTEM = ("Solve the arithmetic. You may call the calculate tool. "
          "Finish with 'ANSWER: <number>'.")


def safe_eval(expression: str) -> float | int:
  """Evaluates arithmetic without `eval`; rejects names, calls and huge powers."""
  if len(expression) > 200:
    raise ValueError("expression is longer than 200 characters")

  def ev(node):
    if isinstance(node, ast.Expression):
      return ev(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(
        node.value, bool):
      return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
      v = ev(node.operand)
      return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
      a, b = ev(node.left), ev(node.right)
      if isinstance(node.op, ast.Pow) and (abs(b) > 64 or abs(a) > 10**6):
        raise ValueError("power too large")
      return _OPS[type(node.op)](a, b)
    raise ValueError(f"unsupported syntax: {ast.dump(node)[:60]}")

  try:
    tree = ast.parse(expression, mode="eval")
  except SyntaxError as e:
    raise ValueError(f"not an arithmetic expression: {e.msg}") from None
  return ev(tree)


def _fmt(x) -> str:
  if isinstance(x, float) and x.is_integer():
    x = int(x)
  return str(x)


@register("calculator")
class Calculator(Env):
  version = "2"  # 2: the terminal reward moved from the last step into the verdict
  verifier_version = "1"

  def __init__(self):
    super().__init__()
    self.tools = ToolSet([Tool(
        "calculate", "Evaluate an arithmetic expression",
        {"type": "object", "properties": {"expression": {"type": "string"}},
         "required": ["expression"], "additionalProperties": False},
        lambda expression: _fmt(safe_eval(expression)))])

  async def reset(self, task: TaskSpec) -> Observation:
    p = task.params
    self.task = task
    self.expression = str(p["expression"])
    self.answer = safe_eval(self.expression)
    self.max_turns = int(p.get("max_turns", 4))
    self.turns, self.done, self.final = 0, False, None
    self.reset_counters()
    question = p.get("question", "What is {expression}?").format(expression=self.expression)
    return Observation([{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": question}], self.tools.schemas())

  async def step(self, action: str) -> StepResult:
    run = await self.tools.run_turn(self, action)
    terminated = False
    messages = run.messages
    if not run.messages:  # no tool call: this is the final answer
      m = _ANSWER.search(action) or re.search(r"(-?\d+(?:\.\d+)?)\s*$", action.strip())
      self.final = float(m.group(1)) if m else None
      terminated = True
      messages = []
    truncated = not terminated and self.turns >= self.max_turns
    self.done = terminated or truncated
    info = self._info(tool_latency_s=run.latencies_s)
    if truncated:
      info["truncation"] = "turn_budget"
    return StepResult(Observation(messages), 0.0, terminated, truncated, info)

  def _correct(self) -> bool:
    return self.final is not None and abs(self.final - float(self.answer)) < 1e-6

  async def verify(self) -> Verdict:
    ok = self._correct()
    return Verdict(VerdictStatus.PASS if ok else VerdictStatus.FAIL, 1.0 if ok else 0.0,
                   f"{self.name}@{self.version}", f"{self.name}@{self.verifier_version}",
                   {"answer": self.answer, "final": self.final})

  def reference_action(self) -> str:
    return f"ANSWER: {_fmt(self.answer)}"


def make_tasks(n: int, *, seed: int = 0) -> list[TaskSpec]:
  rng = random.Random(seed)
  tasks = []
  for i in range(n):
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 20)
    op1, op2 = rng.choice("+-*"), rng.choice("+-*")
    tasks.append(TaskSpec(f"calculator/{seed}-{i}", "calculator",
                          {"expression": f"{a} {op1} {b} {op2} {c}"}))
  return tasks
