"""Tools declared with JSON schemas, and the model's tool calls run against them.

Tool calls are parsed from the model's text in the chat template's format
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, see
`jaxagent.toolcalls`). A malformed call, an unknown tool or arguments that do
not match the schema become an error message for the model and a counted
`invalid_tool_call`; a tool that raises becomes an error message and a
counted `tool_error`. Nothing the policy writes ends an episode by raising; a tool
that returns what is not text (None, a set) is the environment's bug, and raises. A
tool's plain (not async) function runs in a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import inspect
import json
import time
from typing import Any, Awaitable, Callable, Optional, Union

import jsonschema

from envs import waits
from jaxagent.errors import InfraError
from jaxagent.toolcalls import ParsedOutput, parameters_problem, parse_tool_calls

ToolFn = Callable[..., Union[str, Awaitable[str]]]


@dataclasses.dataclass(frozen=True)
class Tool:
  name: str
  description: str
  parameters: dict  # JSON schema of the arguments object
  fn: ToolFn
  # A plain (not async) `fn` runs in a worker thread, so that one that blocks does not
  # stop the event loop; False runs it on the loop (a function that needs the loop's
  # thread: an sqlite3 connection made in reset, asyncio calls).
  in_thread: bool = True

  def schema(self) -> dict:
    """The OpenAI `tools` entry."""
    return {"type": "function", "function": {"name": self.name, "description": self.description,
                                             "parameters": self.parameters}}


@dataclasses.dataclass
class ToolRun:
  """What one assistant turn's tool calls produced."""

  parsed: ParsedOutput
  messages: list[dict]  # tool-result messages, in call order
  calls: int = 0
  invalid: int = 0
  errors: int = 0
  latencies_s: list[float] = dataclasses.field(default_factory=list)


_THREADS: list = []


def _threads():
  """The threads tools' plain functions run on: counted (`jaxagent.pools`), so that a
  process at its end leaves one that blocks for ever behind instead of joining it."""
  if not _THREADS:
    from jaxagent.pools import CountedPool

    _THREADS.append(CountedPool(32, "jaxagent-tool", wait_at_close=False))
  return _THREADS[0]


def _reply(name: str, out: Any, fn: Any = None) -> tuple[str, str]:
  """A tool's return value as (status, the text the model is shown): a string as it is,
  a JSON value (a dict, list, number or bool) as JSON; a number JSON cannot hold (inf,
  NaN: the policy's arguments can make one) is the call's error. Anything else (None, a
  set, an object) is the environment's bug, not the policy's: it raises, naming the tool
  (None was shown to the model as `null`, a set as the policy's failed call)."""
  if isinstance(out, str):
    return "ok", out
  if out is not None:
    try:
      return "ok", json.dumps(out, allow_nan=False)
    except TypeError:
      pass
    except ValueError:  # (a non-finite number, when the rest is JSON; or a cycle)
      try:
        json.dumps(out)
        return "error", f"error: {name} returned a number JSON cannot hold: {out!r:.80}"
      except (TypeError, ValueError):
        pass
  where = ""  # (the tool's own line: the error's was this file's, a new user)
  with contextlib.suppress(TypeError, OSError):
    where = f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}: "
  raise TypeError(f"{where}tool {name!r} returned {type(out).__name__} {out!r:.80}: a tool "
                  "returns a string (or a JSON value: a dict, list, number or bool)")


async def _in_thread(fn, arguments: dict):
  """`fn(**arguments)` on a tool thread, with the caller's context (its waits count on the
  call's clock); the wait for a free thread is marked as the infrastructure's (a crowded
  pool makes a call slower, not the policy's)."""
  loop = asyncio.get_running_loop()
  started = asyncio.Event()
  context = contextvars.copy_context()

  def run():
    loop.call_soon_threadsafe(started.set)
    return context.run(fn, **arguments)

  call = loop.run_in_executor(_threads(), run)
  began = asyncio.ensure_future(started.wait())
  try:
    with waits.waiting():
      await asyncio.wait([call, began], return_when=asyncio.FIRST_COMPLETED)
  finally:
    began.cancel()
  return await call


# What an error reply quotes of the call (the name, the argument's path, jsonschema's
# message with the value's repr): the policy's own input, said back whole and about 4x
# larger (a raw \x7f is 4 characters of repr), made observations of 17M characters from
# a 4 MB action (red team 29).
QUOTED_CHARS = 200


def echoed(text: str) -> str:
  """`text` cut to QUOTED_CHARS, saying the length it had."""
  return text if len(text) <= QUOTED_CHARS else (
      f"{text[:QUOTED_CHARS]}... ({len(text)} characters)")


class ToolSet:
  """Tools by name. At most `max_calls_per_turn` calls of a turn are run (the rest are
  answered as invalid, unrun): a turn's work stays bounded whatever the model writes,
  so a policy cannot stretch one environment step past an environment worker's
  deadline (which would turn its episode into an infrastructure failure, dropped
  instead of scored). At most `max_blocks_per_turn` tool-call blocks, well-formed or not,
  are read and answered one by one; the rest are counted as invalid calls and answered
  together (300,000 malformed blocks in one action held a worker's loop 2.4 s for a
  36 MB answer; red team 115)."""

  def __init__(self, tools: list[Tool], max_calls_per_turn: int = 4,
               max_blocks_per_turn: Optional[int] = None):
    self.tools = {t.name: t for t in tools}
    self.max_calls_per_turn = max_calls_per_turn
    self.max_blocks_per_turn = (8 * max_calls_per_turn if max_blocks_per_turn is None
                                else max_blocks_per_turn)
    for t in tools:  # (jsonschema's dump of its metaschema named neither the tool nor
      # where; a new user)
      problem = parameters_problem(t.parameters)
      if problem is not None:
        raise ValueError(f"tool {t.name!r}: {problem}")

  def schemas(self) -> list[dict]:
    return [t.schema() for t in self.tools.values()]

  async def call(self, name: str, arguments: Any) -> tuple[str, str]:
    """Runs one call; returns (status, text) with status ok | invalid | error."""
    tool = self.tools.get(name)
    if tool is None:
      return "invalid", (f"error: unknown tool {echoed(repr(name))}; available: "
                         f"{sorted(self.tools)}")
    try:
      jsonschema.validate(arguments, tool.parameters)
    except jsonschema.ValidationError as e:
      where = echoed("/".join(map(str, e.absolute_path)) or "arguments")
      return "invalid", f"error: bad arguments for {name} at {where}: {echoed(e.message)}"
    try:
      if not tool.in_thread or inspect.iscoroutinefunction(tool.fn) or \
          inspect.iscoroutinefunction(getattr(tool.fn, "__call__", None)):
        out = tool.fn(**arguments)
      else:  # (a plain function that blocked stopped the event loop, and every other
        # episode, deadline and signal with it: a new user)
        out = await _in_thread(tool.fn, arguments)
      if inspect.isawaitable(out):
        out = await out
    except (asyncio.CancelledError, InfraError):  # the infrastructure's, not the policy's
      raise
    except Exception as e:  # the tool failed: tell the model, keep the episode
      # (cut: an error may quote the arguments, a 4 MB path said back whole)
      return "error", f"error: {name} failed: {type(e).__name__}: {echoed(str(e))}"
    return _reply(name, out, tool.fn)

  async def run_turn(self, env, text: str) -> ToolRun:
    """One environment turn of tool use: counts the turn, runs the calls, and adds the
    call counters to `env.counters`."""
    env.begin_turn()
    run = await self.run(text)
    env.counters["tool_calls"] += run.calls
    env.counters["invalid_tool_calls"] += run.invalid
    env.counters["tool_errors"] += run.errors
    return run

  async def run(self, text: str) -> ToolRun:
    """Parses `text` and runs every tool call in it."""
    parsed = parse_tool_calls(text, limit=self.max_blocks_per_turn)
    result = ToolRun(parsed, [])
    # (answered in the order the blocks were written: with the malformed ones' answers
    # first, a template that pairs results with calls by place paired them wrongly; a
    # red team)
    for kind, n in parsed.order:
      if kind == "error":  # (calls too, invalid ones: counted as invalid alone, a turn
        # of one good call and one malformed read as "no call ran"; a reviewer)
        result.calls += 1
        result.invalid += 1
        result.messages.append({"role": "tool", "content":
                                f"error: malformed tool call: {parsed.errors[n]}"})
        continue
      call = parsed.calls[n]
      # (a tool's own name; an unknown one is the model's text, of any length, special
      # tokens and all, which a template that writes a tool message's name would put
      # into the prompt as they are: said back in the message's content alone; a reviewer)
      named = {"name": call.name} if call.name in self.tools else {}
      if n >= self.max_calls_per_turn:
        result.calls += 1
        result.invalid += 1
        result.messages.append({"role": "tool", "tool_call_id": call.id, **named,
                                "content": f"error: at most {self.max_calls_per_turn} tool "
                                           "calls are run a turn; this one was not run"})
        continue
      t0 = time.perf_counter()
      status, out = await self.call(call.name, call.arguments)
      result.latencies_s.append(time.perf_counter() - t0)
      result.calls += 1
      result.invalid += status == "invalid"
      result.errors += status == "error"
      result.messages.append({"role": "tool", "tool_call_id": call.id, **named,
                              "content": out})
    if parsed.unread:  # (counted as calls, as those past max_calls_per_turn are)
      result.calls += parsed.unread
      result.invalid += parsed.unread
      result.messages.append({"role": "tool", "content": (
          f"error: {parsed.unread} more tool calls were not read: at most "
          f"{self.max_blocks_per_turn} are read a turn")})
    return result
