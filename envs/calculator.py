"""`calculator`: arithmetic word tasks with a `calculate` tool.

The model may call `calculate(expression)` (evaluated safely: numbers,
+ - * / // % ** and parentheses, bounded sizes) and ends with a line
`ANSWER: <number>`. The verdict pays 1 for the right final answer (steps pay
no process reward). The first observation holds two worked exchanges
(`EXAMPLES`, task option `examples`), so that a small instruct model (SmolLM2-135M)
calls the tool in the chat template's format rather than guessing.

`python -m envs.calculator` writes `envs/tasks/calculator.jsonl`.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import random
import re
import unicodedata
from fractions import Fraction

from envs import pyparse
from envs.base import (Env, Observation, StepResult, TaskSpec, Verdict, VerdictStatus, register,
                       task_int, task_known, task_text)
from envs.tools import Tool, ToolSet

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
        ast.Pow: operator.pow}
# The final answer is a line of its own, `ANSWER: <number>` (any case; an optional
# trailing period); the last such line counts. Nothing else is read as an answer: not a
# number at the end of other text, not the digits of an identifier (`calculate_82_66`).
# Possessive quantifiers: the blanks' runs never give back, so a line of 120k blanks
# after an answer and a last character that is not one is rejected at once (the
# backtracking took 26 s on the event loop, on a worker past its clients' timeout: a
# wrong answer re-rolled; red team). A line may end in \r (a CRLF text's answer).
_ANSWER = re.compile(r"^[ \t]*+ANSWER:[ \t]*+(-?\d++(?:\.\d++)?)[ \t]*+\.?[ \t\r]*+$",
                     re.IGNORECASE | re.MULTILINE)
SYSTEM = ("Solve the arithmetic. You may call the calculate tool. "
          "Finish with 'ANSWER: <number>'.")


def _example(question: str, expression: str, result: str, call_id: str) -> list[dict]:
  """One worked exchange in OpenAI message shape: question, tool call, result, answer."""
  call = {"id": call_id, "type": "function",
          "function": {"name": "calculate", "arguments": json.dumps({"expression": expression})}}
  return [{"role": "user", "content": question},
          {"role": "assistant", "content": "", "tool_calls": [call]},
          {"role": "tool", "tool_call_id": call_id, "name": "calculate", "content": result},
          {"role": "assistant", "content": f"ANSWER: {result}"}]


EXAMPLES = (_example("What is 3 * 41 + 2?", "3 * 41 + 2", "125", "example_0")
            + _example("What is 88 - 17 * 3?", "88 - 17 * 3", "37", "example_1"))


def final_answer(text: str) -> int | Fraction | None:
  """The number on the last `ANSWER: <number>` line of `text`, or None (as for a number
  past a float's range: no task's answer, and not a value JSON can carry). Exactly as
  written: a whole number (`87`, `87.0`) is an int (past 2**53 a float rounds, and an
  answer off by one matched: red team), any other a Fraction of its decimal digits (as
  a float, a right `33333333333.3333333` was off by more than the tolerance: red team
  29)."""
  found = _ANSWER.findall(text)
  if not found:
    return None
  # (digits of any script, as `\d` and float() read them, in ASCII: zeros of another
  # script were not dropped below, and 4,400 of them raised out of the step; red team 42)
  written = "".join(c if c in "-." else str(unicodedata.decimal(c)) for c in found[-1])
  value = float(written)
  if not math.isfinite(value):
    return None
  whole, _, fraction = written.partition(".")
  # (leading zeros dropped: 4,300 of them before a 1 made int() raise out of the step,
  # and the run stop, as an environment's bug: red team; the whole part is within a
  # float's range, so 309 digits at most)
  digits = whole.lstrip("-").lstrip("0") or "0"
  # (decimals past ANSWER_DECIMALS change no answer within a float's range by a
  # millionth of its size; read whole, 4,300 of them raised as the zeros did)
  fraction = fraction[:ANSWER_DECIMALS].rstrip("0")
  value = Fraction(int(digits) * 10 ** len(fraction) + int(fraction or "0"),
                   10 ** len(fraction))
  if value.denominator == 1:
    value = int(value)
  return -value if whole.startswith("-") else value


MAX_INT_BITS = 4000  # (1,204 digits: far past any answer, well within what prints)
ANSWER_DECIMALS = 400  # the decimals of an answer read (a float's smallest is 1e-308)


def _within_float(value: int | float) -> bool:
  """Finite, and (an int) within a float's range: `final_answer` reads no larger number."""
  try:
    return math.isfinite(value)
  except OverflowError:  # (an int past 1.8e308)
    return False


def safe_eval(expression: str, *, exact: bool = False) -> float | int | Fraction:
  """Evaluates arithmetic without `eval`; rejects names, calls and huge powers."""
  if len(expression) > 200:
    raise ValueError("expression is longer than 200 characters")

  def ev(node):
    if isinstance(node, ast.Expression):
      return ev(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(
        node.value, bool):
      if exact and isinstance(node.value, float) and math.isfinite(node.value):
        # (the decimal as written: 0.1 + 0.2 - 0.3 is 0, not the floats' 5.6e-17, which
        # a right `ANSWER: 0` missed by more than a millionth of it: a reviewer)
        value = Fraction(repr(node.value))
        return int(value) if value.denominator == 1 else value
      return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
      v = ev(node.operand)
      return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
      a, b = ev(node.left), ev(node.right)
      if isinstance(node.op, ast.Pow) and (abs(b) > 64 or abs(a) > 10**6):
        raise ValueError("power too large")
      if exact and isinstance(node.op, ast.Div) and isinstance(a, (int, Fraction)) \
          and isinstance(b, (int, Fraction)) and b != 0:
        value = Fraction(a) / b  # (exactly: a float rounds past 2**53)
      elif exact and isinstance(node.op, ast.Pow) and isinstance(a, (int, Fraction)) \
          and isinstance(b, int) and b < 0 and a != 0:
        # (exactly: a float's 2 ** -40 was graded with the floor fractional powers get,
        # and `ANSWER: 0` passed it; a reviewer)
        value = Fraction(a) ** b
      else:
        value = _OPS[type(node.op)](a, b)
      if isinstance(value, Fraction) and value.denominator == 1:
        value = int(value)
      if isinstance(value, (int, Fraction)) and max(  # (an int: itself over 1)
          abs(value.numerator), value.denominator).bit_length() > MAX_INT_BITS:
        # (products of allowed powers reached 6,900 digits: Python would not print them,
        # and said to raise its limit, a server's setting: a walkthrough)
        raise ValueError(f"the value has over {MAX_INT_BITS * 3 // 10} digits: too large")
      return value
    raise ValueError(f"unsupported syntax: {ast.dump(node)[:60]}")

  try:
    tree = pyparse.parse(expression, mode="eval")
  except SyntaxError as e:
    raise ValueError(f"not an arithmetic expression: {e.msg}") from None
  return ev(tree)


def _plain(x):
  """`x` as JSON carries it (an exact quotient as its float)."""
  return float(x) if isinstance(x, Fraction) else x


def _fmt(x) -> str:
  x = _plain(x)
  if isinstance(x, float) and x.is_integer():
    x = int(x)
  return str(x)


@register("calculator")
class Calculator(Env):
  # 2: the terminal reward moved from the last step into the verdict. 3: two worked
  # examples in the first observation; only an `ANSWER: <number>` line is an answer.
  version = "3"
  # 2: no trailing-number fallback. 3: a quotient's answer within a relative 1e-6, read
  # exactly (an absolute 1e-6 passed `ANSWER: 0` for 1 / 3000000: red team 29). 4: a
  # negative whole power read exactly too (`ANSWER: 0` passed 2 ** -40).
  verifier_version = "4"

  def __init__(self):
    super().__init__()
    self.tools = ToolSet([Tool(
        "calculate", "Evaluate an arithmetic expression",
        {"type": "object", "properties": {"expression": {"type": "string"}},
         "required": ["expression"], "additionalProperties": False},
        lambda expression: _fmt(safe_eval(expression)))])

  async def reset(self, task: TaskSpec) -> Observation:
    p = task.params
    task_known(p, ("expression", "question", "examples", "max_turns"), task.id)
    self.task = task
    if "expression" not in p:  # (it was the KeyError's line: a red team)
      raise ValueError(f"task {task.id}: params need 'expression' (the arithmetic to "
                       "answer)")
    self.expression = str(p["expression"])
    try:
      self.answer = safe_eval(self.expression, exact=True)
    except ArithmeticError as e:  # (1/0, a float power past range: the task's fault)
      raise ValueError(f"task {task.id}: {self.expression}: {type(e).__name__}: {e}") \
          from None
    if isinstance(self.answer, complex) or not _within_float(self.answer):
      raise ValueError(f"task {task.id}: {self.expression} has no finite real value "
                       f"within a float's range ({_fmt(self.answer)[:40]}): no answer can "
                       "match it")
    self.max_turns = task_int(p, "max_turns", 4, task.id)
    self.turns, self.done, self.final = 0, False, None
    self.reset_counters()
    question = task_text(p.get("question", "What is {expression}?"), "question", task.id,
                         expression=self.expression)
    shots = task_int(p, "examples", 2, task.id)
    if not 0 <= shots <= len(EXAMPLES) // 4:
      raise ValueError(f"task {task.id}: examples must be 0..{len(EXAMPLES) // 4}, got {shots}")
    examples = [dict(m) for m in EXAMPLES[:4 * shots]]
    return Observation([{"role": "system", "content": SYSTEM}, *examples,
                        {"role": "user", "content": question}], self.tools.schemas())

  async def step(self, action: str) -> StepResult:
    run = await self.tools.run_turn(self, action)
    terminated = False
    messages = run.messages
    if not run.messages:  # no tool call: this is the final answer
      self.final = final_answer(action)
      terminated = True
      messages = []
    truncated = not terminated and self.turns >= self.max_turns
    self.done = terminated or truncated
    info = self._info(tool_latency_s=run.latencies_s)
    if truncated:
      info["truncation"] = "turn_budget"
    return StepResult(Observation(messages), 0.0, terminated, truncated, info)

  def _correct(self) -> bool:
    if self.final is None:
      return False
    if isinstance(self.answer, int):  # (exactly: floats past 2**53 round; a reply with
      # a fraction is not a whole number, however close: red team)
      return isinstance(self.final, int) and self.final == self.answer
    # (a quotient, exact: its float rounds past 2**53; a float answer's own error stays)
    # Within a millionth of its size: six significant digits and a bit more, as the
    # tool's float repr has (an absolute 1e-6 passed 0 for 1 / 3000000, and failed the
    # float repr of 100000000000 / 3: red team 29).
    diff, tolerance = abs(Fraction(self.final) - Fraction(self.answer)), \
        abs(Fraction(self.answer)) / 10**6
    if isinstance(self.answer, float):  # (a fractional power: its rounding near 0)
      tolerance = max(tolerance, Fraction(1, 10**12))
    return diff == 0 or diff < tolerance

  async def verify(self) -> Verdict:
    ok = self._correct()
    return Verdict(VerdictStatus.PASS if ok else VerdictStatus.FAIL, 1.0 if ok else 0.0,
                   f"{self.name}@{self.version}", f"{self.name}@{self.verifier_version}",
                   {"answer": _plain(self.answer), "final": _plain(self.final)})

  def reference_action(self) -> str:
    return f"ANSWER: {_fmt(self.answer)}"


def make_tasks(n: int, *, seed: int = 0) -> list[TaskSpec]:
  """`n` tasks `a op b op c` (a, b in 2..99, c in 2..20, op in + - *): results up to ~10^5,
  some negative; hard to get right without the tool for a small model."""
  rng = random.Random(seed)
  tasks = []
  for i in range(n):
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 20)
    op1, op2 = rng.choice("+-*"), rng.choice("+-*")
    tasks.append(TaskSpec(f"calculator/{seed}-{i}", "calculator",
                          {"expression": f"{a} {op1} {b} {op2} {c}"}))
  return tasks


if __name__ == "__main__":  # writes a task file (the SmolLM2 run's: --out envs/tasks/calculator.jsonl)
  import sys

  from envs.base import task_file_parser, write_task_file

  ap = task_file_parser("python -m envs.calculator", "calculator")
  a = ap.parse_args()
  sys.exit(write_task_file(ap.prog, a.out, make_tasks(a.n, seed=a.seed)))
