import asyncio

import pytest

from envs.tools import Tool, ToolSet


def boom(**_):
  raise RuntimeError("disk on fire")


async def slow_add(a: int, b: int) -> str:
  await asyncio.sleep(0)
  return str(a + b)


TOOLS = ToolSet([
    Tool("add", "add", {"type": "object", "properties": {"a": {"type": "integer"},
                                                        "b": {"type": "integer"}},
                        "required": ["a", "b"], "additionalProperties": False}, slow_add),
    Tool("boom", "fails", {"type": "object", "properties": {}}, boom),
])


def run(text):
  return asyncio.run(TOOLS.run(text))


def test_good_call():
  r = run('Let me add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
  assert (r.calls, r.invalid, r.errors) == (1, 0, 0)
  assert r.messages == [{"role": "tool", "tool_call_id": "call_0", "name": "add", "content": "5"}]
  assert r.parsed.content == "Let me add."


@pytest.mark.parametrize("text,needle", [
    ('<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>', "'b' is a required"),
    ('<tool_call>{"name": "add", "arguments": {"a": "x", "b": 1}}</tool_call>', "at a"),
    ('<tool_call>{"name": "mul", "arguments": {}}</tool_call>', "unknown tool 'mul'"),
    ('<tool_call>{"name": add}</tool_call>', "malformed"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}', "missing </tool_call>"),
    ('<tool_call>[1, 2]</tool_call>', "malformed"),
    # Python's json takes NaN and Infinity; they are not JSON and cannot be sent back out.
    ('<tool_call>{"name": "add", "arguments": {"a": NaN, "b": 1}}</tool_call>', "NaN"),
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": Infinity}"}</tool_call>',
     "Infinity"),
    # ... nor does a number past a float's range, which reads as infinity (a red-team
    # finding: the Anthropic gateway could not send it back, an infra error, a re-roll).
    ('<tool_call>{"name": "add", "arguments": {"a": 1e999, "b": 1}}</tool_call>',
     "overflows a float"),
])
def test_bad_calls_become_error_observations(text, needle):
  r = run(text)
  assert r.invalid == 1 and r.calls == 1 and len(r.messages) == 1
  assert r.messages[0]["content"].startswith("error") and needle in r.messages[0]["content"]


def test_a_turns_blocks_past_the_read_limit_are_counted_and_answered_together():
  """300,000 malformed blocks in one action held a worker's loop 2.4 s and answered
  36 MB (red team 115): blocks past `max_blocks_per_turn` are counted, not read."""
  good = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
  bad = '<tool_call>{"name": add}</tool_call>'
  r = run(bad + good * 2 + bad * 300_000)
  assert TOOLS.max_blocks_per_turn == 32
  # (2 good, 30 read malformed, 299,971 unread: every block a call)
  assert (r.calls, r.invalid) == (2 + 30 + 299_971, 300_001)
  assert len(r.messages) == 33
  assert [m["content"] for m in r.messages[1:3]] == ["3", "3"]  # (in the written order)
  assert r.messages[-1]["content"] == (
      "error: 299971 more tool calls were not read: at most 32 are read a turn")
  assert sum(len(m["content"]) for m in r.messages) < 4000
  fewer = asyncio.run(ToolSet(list(TOOLS.tools.values()), max_calls_per_turn=1).run(
      good * 3 + bad * 10))
  # (8 read: 1 run, 2 unrun, 5 bad; 5 unread)
  assert (fewer.calls, fewer.invalid) == (3 + 5 + 5, 2 + 10)
  assert fewer.messages[-1]["content"].startswith("error: 5 more tool calls")


def test_an_error_reply_quotes_a_call_cut_short():
  """An argument's value and a tool's name are said back in at most a few hundred
  characters: jsonschema's message holds the value's repr (a raw \\x7f is 4 characters of
  it), and 4 MB actions became observations of 17M characters (red team 29)."""
  import json

  big = "\x7f" * 1_000_000
  for call in ({"name": "add", "arguments": {"a": [big], "b": 1}},
               {"name": "add", "arguments": {big: 1, "a": 1, "b": 2}},
               {"name": big, "arguments": {}}):
    r = run(f"<tool_call>{json.dumps(call, ensure_ascii=False)}</tool_call>")
    said = r.messages[0]["content"]
    assert r.invalid == 1 and said.startswith("error") and len(said) < 700, len(said)
    assert "characters)" in said
  # ...and a tool's own error that quotes its arguments (a path outside the workspace)

  def refuse(path: str):
    raise ValueError(f"path {path!r} is outside the workspace")

  tools = ToolSet([Tool("write", "w", {"type": "object", "properties": {
      "path": {"type": "string"}}}, refuse)])
  r = asyncio.run(tools.run(
      f"<tool_call>{json.dumps({'name': 'write', 'arguments': {'path': big}})}</tool_call>"))
  said = r.messages[0]["content"]
  assert r.errors == 1 and "outside the workspace" not in said and len(said) < 700


def test_failing_tool_is_an_error_not_an_exception():
  r = run('<tool_call>{"name": "boom", "arguments": {}}</tool_call>')
  assert (r.calls, r.invalid, r.errors) == (1, 0, 1)
  assert "disk on fire" in r.messages[0]["content"]


def test_a_turn_of_a_good_call_and_a_malformed_one_counts_both():
  """A reviewer: a malformed block counted as invalid but not as a call, so a turn of
  one good call and one malformed read as "no call ran" (tool_call_rate: calls >
  invalid)."""
  r = run('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
          "<tool_call>oops</tool_call>")
  assert (r.calls, r.invalid, r.errors) == (2, 1, 0)


def test_an_unknown_tools_name_is_not_said_back_as_a_name():
  """A reviewer: a tool message's `name` carried the model's raw name for an unknown
  tool (megabytes, `<|im_end|>` and all), which a template that writes the name would
  put into the prompt as live text; it is said in the content only, cut."""
  r = run('<tool_call>{"name": "<|im_end|>' + "x" * 10_000 + '", "arguments": {}}</tool_call>'
          '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>')
  unknown, known = r.messages
  assert "name" not in unknown and len(unknown["content"]) < 1000
  assert known["name"] == "add" and known["content"] == "2"


def test_text_without_calls():
  r = run("just an answer")
  assert r.messages == [] and r.calls == 0 and r.parsed.content == "just an answer"


def test_schemas_are_openai_tools_and_checked():
  assert TOOLS.schemas()[0]["function"]["name"] == "add"
  with pytest.raises(Exception):
    ToolSet([Tool("bad", "x", {"type": "nonsense"}, boom)])
  # (jsonschema's dump of its metaschema named neither the tool nor where; a new user)
  with pytest.raises(ValueError, match=r"^tool 'add': its parameters are not a JSON Schema: "
                                       r"'int' is not valid .*\(at parameters\['properties'\]"
                                       r"\['a'\]\['type'\]\)$"):
    ToolSet([Tool("add", "x", {"type": "object", "properties": {"a": {"type": "int"}}},
                  boom)])


def test_a_turns_calls_are_answered_in_the_order_they_were_written():
  """Every malformed block's answer came first: a template that pairs results with
  calls by place paired them wrongly (a red team)."""
  run = asyncio.run(TOOLS.run(
      '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
      '<tool_call>{"name": "add", "arguments": {"a": </tool_call>'
      '<tool_call>{"name": "add", "arguments": {"a": 7, "b": 6}}</tool_call>'))
  said = [m["content"] for m in run.messages]
  assert said[0] == "5" and said[1].startswith("error: malformed tool call: tool call 1")
  assert said[2] == "13" and [m.get("tool_call_id") for m in run.messages] == \
      ["call_0", None, "call_2"]


def test_a_plain_tool_function_runs_off_the_event_loop():
  """A tool written as a plain function that blocks (time.sleep, a lock, a socket) ran
  on the event loop and froze every other episode, the deadlines and the signals with it
  (a new user's hung tool: only kill -9 ended the run). It runs in a thread now."""
  import time

  def sleepy(seconds: float) -> str:
    time.sleep(seconds)
    return "slept"

  tools = ToolSet([Tool("sleepy", "sleeps", {"type": "object", "properties": {
      "seconds": {"type": "number"}}}, sleepy)])

  async def main():
    ticks = 0

    async def tick():
      nonlocal ticks
      while True:
        await asyncio.sleep(0.01)
        ticks += 1

    ticker = asyncio.ensure_future(tick())
    run = await tools.run('<tool_call>{"name": "sleepy", "arguments": {"seconds": 0.5}}'
                          '</tool_call>')
    ticker.cancel()
    return run, ticks

  run, ticks = asyncio.run(main())
  assert run.messages[0]["content"] == "slept" and ticks >= 10, ticks


@pytest.mark.parametrize("value,shown", [({"a": 1}, '{"a": 1}'), ([1, 2], "[1, 2]"),
                                         (3, "3"), (True, "true"), ("x", "x")])
def test_a_tools_json_value_is_shown_as_json(value, shown):
  tools = ToolSet([Tool("t", "t", {"type": "object"}, lambda: value)])
  r = asyncio.run(tools.run('<tool_call>{"name": "t", "arguments": {}}</tool_call>'))
  assert r.messages[0]["content"] == shown and r.errors == 0


@pytest.mark.parametrize("value", [float("inf"), float("nan"), [1.0, float("-inf")]])
def test_a_number_json_cannot_hold_is_the_calls_error_not_a_bug(value):
  """The policy's arguments can make a tool's number infinite (multiply 1e308 by 10):
  the call's error, told to the model, never the run's stop (a reviewer)."""
  tools = ToolSet([Tool("multiply", "t", {"type": "object"}, lambda: value)])
  r = asyncio.run(tools.run('<tool_call>{"name": "multiply", "arguments": {}}</tool_call>'))
  assert r.errors == 1 and "returned a number JSON cannot hold" in r.messages[0]["content"]


def test_a_tool_may_keep_to_the_event_loops_thread():
  """in_thread=False: a function that needs the loop's thread (an sqlite3 connection
  made in reset) runs there; in a thread it failed, shown to the policy as its error."""
  import sqlite3

  db = sqlite3.connect(":memory:")
  query = lambda: str(db.execute("select 41 + 1").fetchone()[0])  # noqa: E731
  for in_thread, errors in ((False, 0), (True, 1)):
    tools = ToolSet([Tool("q", "t", {"type": "object"}, query, in_thread=in_thread)])
    r = asyncio.run(tools.run('<tool_call>{"name": "q", "arguments": {}}</tool_call>'))
    assert r.errors == errors, r.messages
  assert r.messages[0]["content"].startswith("error: q failed: ProgrammingError")


def test_a_wait_for_a_tool_thread_is_the_infrastructures():
  """Every tool thread busy: the call's wait for one is marked a wait (the deadline of an
  environment's call does not count it), its run is not."""
  import time

  from envs import waits

  tools = ToolSet([Tool("nap", "t", {"type": "object"}, lambda: time.sleep(0.3) or "ok")])
  from envs.tools import _threads

  blockers = [_threads().submit(time.sleep, 0.5) for _ in range(32)]

  async def main():
    with waits.measured() as clock:
      r = await tools.run('<tool_call>{"name": "nap", "arguments": {}}</tool_call>')
    return r, clock.total_s()

  r, waited = asyncio.run(main())
  for b in blockers:
    b.result()
  assert r.messages[0]["content"] == "ok" and 0.3 < waited < 0.75, waited


@pytest.mark.parametrize("value", [None, {1, 2}, object()])
def test_a_tool_that_returns_no_text_is_the_environments_bug(value):
  """None was shown to the model as `null`, a set as the policy's failed call (a
  tool_error): both are the environment's bug, which stops the run naming the tool."""
  tools = ToolSet([Tool("convert", "t", {"type": "object"}, lambda: value)])
  with pytest.raises(TypeError, match=r"test_tools.py:\d+: tool 'convert' returned"):
    # (named at the tool's own line: it was envs/tools.py's, a new user)
    asyncio.run(tools.run('<tool_call>{"name": "convert", "arguments": {}}</tool_call>'))


def test_each_call_of_a_turn_answers_to_its_own_id():
  """Two calls in one action, a malformed block between them: each call keeps the id of
  its block (the tool answers are matched to their calls by it; one id for two calls
  gave both answers to the first)."""
  from jaxagent.toolcalls import parse_tool_calls

  text = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
          '<tool_call>{"name": add}</tool_call>'
          '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>')
  parsed = parse_tool_calls(text, id_prefix="turn7")
  assert [c.id for c in parsed.calls] == ["turn7_0", "turn7_2"] and len(parsed.errors) == 1
  assert [c.openai()["id"] for c in parsed.calls] == ["turn7_0", "turn7_2"]
  r = run(text)
  answers = [(m.get("tool_call_id"), m["content"]) for m in r.messages]
  assert sorted(a for a in answers if a[0]) == [("call_0", "3"), ("call_2", "7")]


@pytest.mark.parametrize("body", ['{"name": 5, "arguments": {}}', '{"arguments": {"a": 1}}',
                                  '{"name": null}', '{"name": ["add"], "arguments": {}}'])
def test_a_call_whose_name_is_not_a_string_is_malformed(body):
  from jaxagent.toolcalls import parse_tool_calls

  parsed = parse_tool_calls(f"<tool_call>{body}</tool_call>")
  assert not parsed.calls and len(parsed.errors) == 1
  assert 'a JSON object with a string "name"' in parsed.errors[0]
  r = run(f"<tool_call>{body}</tool_call>")
  assert r.invalid == 1 and "malformed tool call" in r.messages[0]["content"]


@pytest.mark.parametrize("arguments", ['[1, 2]', '3', '"5"', '"[1]"', 'null', '"\\"a\\""'])
def test_arguments_that_are_not_an_object_are_malformed(arguments):
  """Written directly or as a JSON string, arguments that are not an object are the
  call's error, told to the model (never a call run with a list, nor a crash)."""
  from jaxagent.toolcalls import parse_tool_calls

  parsed = parse_tool_calls('<tool_call>{"name": "add", "arguments": %s}</tool_call>'
                            % arguments)
  assert not parsed.calls and len(parsed.errors) == 1
  assert '"arguments" must be a JSON object' in parsed.errors[0]
  r = run('<tool_call>{"name": "add", "arguments": %s}</tool_call>' % arguments)
  assert r.invalid == 1 and "malformed tool call" in r.messages[0]["content"]


def test_the_kept_text_takes_out_only_the_well_formed_calls():
  """`kept` (what a gateway's client is given as the reply's content when a block is
  malformed) keeps a malformed block and one the model left open, as written."""
  from jaxagent.toolcalls import parse_tool_calls

  good = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
  text = (' A <tool_call>{"name": add}</tool_call> B ' + good + ' C '
          '<tool_call>{"name": "add", "arguments": {"a": 1')
  parsed = parse_tool_calls(text)
  assert [c.arguments for c in parsed.calls] == [{"a": 1, "b": 2}]
  assert parsed.errors[0].startswith("tool call 0: ") and \
      parsed.errors[1] == "tool call 2: missing </tool_call>"
  assert parsed.kept == text.replace(good, "")
  assert parsed.content == "A  B  C"


@pytest.mark.parametrize("body", [
    '{"name": "add", "arguments": {"a": 1, "b": 2}} trailing',
    '{"name": "add", "arguments": {"a": 1, "b": 2}}}',
    '{"name": "add", "arguments": {"a": 1, "b": 2}} {"name": "add"}'])
def test_a_call_with_text_after_its_json_object_is_malformed(body):
  from jaxagent.toolcalls import parse_tool_calls

  parsed = parse_tool_calls(f"<tool_call>{body}</tool_call>")
  assert not parsed.calls and len(parsed.errors) == 1
  assert parsed.errors[0].startswith("tool call 0: Extra data")
