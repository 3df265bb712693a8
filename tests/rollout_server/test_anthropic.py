"""The Anthropic-compatible gateway (`POST /v1/messages`) against real servers on loopback
ports, through the official `anthropic` client: messages, a tool-use round trip, streams,
errors in Anthropic's shape, session records token-exact, the router, and a black-box
agent written against the client that trains (as one written against the `openai`
client's Responses API does)."""

import asyncio
import json
import os
import subprocess
import sys

import anthropic
import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from envs.base import Env, Observation, StepResult, TaskSpec, Verdict, VerdictStatus
from envs.calculator import EXAMPLES, SYSTEM, safe_eval
from envs.tools import Tool, ToolSet
from jaxagent.blackbox import anthropic_messages, collect_session, run_blackbox
from jaxagent.config import AgentConfig
from jaxagent.trajectory import CLEAN, read_jsonl
from rollout_server.anthropic_api import MessagesBody, chat_messages, message_body, stream_events
from rollout_server.router import create_router
from rollout_server.serving import ServerThread
from tests.conftest import REPO
from tests.rollout_server.conftest import MEMORISED, TOOLS, finished_turn

# Recent clients send sampling settings only as extra body fields.
GREEDY = {"temperature": 0}
# The conftest's tool in Anthropic's shape: it renders to the same prompt.
CALCULATE = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]


def test_messages_convert_to_the_openai_form_by_hand():
  body = MessagesBody.model_validate({
      "model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "Be brief."}],
      "tools": [{"name": "f", "description": "F", "input_schema": {"type": "object"},
                 "cache_control": {"type": "ephemeral"}}],
      "messages": [
          {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": [
              {"type": "text", "text": "Two calls."},
              {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}},
              {"type": "tool_use", "id": "t2", "name": "f", "input": {}}]},
          {"role": "user", "content": [
              {"type": "tool_result", "tool_use_id": "t1", "content": "one"},
              {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
               "content": [{"type": "text", "text": "bad "}, {"type": "text", "text": "x"}]},
              {"type": "text", "text": "Go "}, {"type": "text", "text": "on."}]}]})
  messages, tools = chat_messages(body)
  assert tools == [{"type": "function", "function": {"name": "f", "description": "F",
                                                     "parameters": {"type": "object"}}}]
  assert messages == [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Two calls.", "tool_calls": [
          {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
          {"id": "t2", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "t1", "content": "one"},
      {"role": "tool", "tool_call_id": "t2", "content": "bad x", "is_error": True},
      {"role": "user", "content": "Go on."}]
  # Consecutive messages of a role are one turn, as Anthropic's API takes them (red team
  # 24: a tool use answered after two assistant messages was refused; two user messages
  # rendered as two turns).
  body = MessagesBody.model_validate({"model": "m", "max_tokens": 8, "messages": [
      {"role": "user", "content": "a"}, {"role": "user", "content": [
          {"type": "text", "text": "b"}]},
      {"role": "assistant", "content": [
          {"type": "tool_use", "id": "t1", "name": "f", "input": {"q": "café"}}]},
      {"role": "assistant", "content": "Then."},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}]},
      {"role": "user", "content": "c"}, {"role": "assistant", "content": ""},
      {"role": "user", "content": "d"}]})
  assert chat_messages(body)[0] == [
      {"role": "user", "content": "ab"},
      {"role": "assistant", "content": "Then.", "tool_calls": [
          {"id": "t1", "type": "function", "function": {"name": "f",
                                                        "arguments": '{"q": "café"}'}}]},
      {"role": "tool", "tool_call_id": "t1", "content": "r"},
      {"role": "user", "content": "c"}, {"role": "assistant", "content": ""},
      {"role": "user", "content": "d"}]  # (a reply the policy left empty, sent back)


def test_an_assistants_text_blocks_join_as_written_into_a_message_without_calls():
  """An assistant message of several text blocks and no tool use is one chat message of
  their text joined with nothing between (as a user's blocks are, and as the reply was
  sampled), with no `tool_calls` field: a separator between blocks, or an empty list of
  calls, put into the prompt and the session record what the policy never wrote."""
  body = MessagesBody.model_validate({"model": "m", "max_tokens": 8, "messages": [
      {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": [{"type": "text", "text": "Hel"},
                                        {"type": "text", "text": "lo."}]},
      {"role": "user", "content": "Go on."}]})
  assert chat_messages(body)[0][1] == {"role": "assistant", "content": "Hello."}


def test_runs_of_messages_of_a_role_keep_every_call_result_and_text_in_order():
  """Runs of messages of one role are one turn, nothing of them lost or moved: three user
  messages' text in order; two assistant messages' tool uses all one reply's calls (the
  second's replaced the first's: a result then answered a call the prompt lost); a result
  after a user's text stays a `tool` message (merged into the text, it vanished as a
  result). A result for a tool use of an earlier reply, not the last one, is refused."""
  def use(i):
    return {"type": "tool_use", "id": f"t{i}", "name": "f", "input": {}}

  def result(i):
    return {"type": "tool_result", "tool_use_id": f"t{i}", "content": f"r{i}"}

  body = MessagesBody.model_validate({"model": "m", "max_tokens": 8, "messages": [
      {"role": "user", "content": "a"}, {"role": "user", "content": "b"},
      {"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "c"}]},
      {"role": "assistant", "content": [use(1)]}, {"role": "assistant", "content": [use(2)]},
      {"role": "user", "content": [result(1), {"type": "text", "text": "x"}]},
      {"role": "user", "content": [result(2)]}, {"role": "user", "content": "d"}]})
  calls = [{"id": f"t{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
           for i in (1, 2)]
  assert chat_messages(body)[0] == [
      {"role": "user", "content": "abc"},
      {"role": "assistant", "content": "", "tool_calls": calls},
      {"role": "tool", "tool_call_id": "t1", "content": "r1"},
      {"role": "user", "content": "x"},
      {"role": "tool", "tool_call_id": "t2", "content": "r2"},
      {"role": "user", "content": "d"}]
  stale = MessagesBody.model_validate({"model": "m", "max_tokens": 8, "messages": [
      {"role": "user", "content": "a"}, {"role": "assistant", "content": [use(1)]},
      {"role": "user", "content": [result(1)]}, {"role": "assistant", "content": "ok"},
      {"role": "user", "content": [result(1)]}]})
  with pytest.raises(ValueError, match="messages.4.content.0: tool_result for tool_use_id"):
    chat_messages(stale)


def test_an_environment_chat_renders_alike_through_either_gateway(tokenizer):
  """The calculator's worked examples (OpenAI's shape), put in Anthropic's shape by the
  agent and back by the server, render to the same tokens."""
  chat = [{"role": "system", "content": SYSTEM}] + list(EXAMPLES) + [
      {"role": "user", "content": "What is 6 * 7?"}]
  system, messages = anthropic_messages(chat)
  body = MessagesBody(model="m", max_tokens=8, system=system, messages=messages,
                      tools=[{"name": "calculate", "description": "Evaluate an arithmetic "
                              "expression", "input_schema": TOOLS[0]["function"]["parameters"]}])
  back, tools = chat_messages(body)
  assert tools == TOOLS
  assert tokenizer.apply_chat_template(back, tools) == tokenizer.apply_chat_template(chat, TOOLS)


def test_a_tool_message_that_answers_no_tool_use_is_text():
  """The environment's error for a malformed tool call (no tool use in the reply, no id)
  went as a tool_result of id '', which the gateway refuses: a 400, and the episode of
  a wrong answer ended as the server's failure, re-rolled (a red team's round)."""
  error = [{"role": "tool", "content": "error: malformed tool call: bad JSON"}]
  assert anthropic_messages(error)[1] == [
      {"role": "user", "content": [{"type": "text", "text": error[0]["content"]}]}]
  # A valid call beside a malformed one: the error (first, as ToolSet answers) is text,
  # the result answers the call (a reviewer's round: it took the call's id).
  result = {"role": "tool", "tool_call_id": "call_1", "name": "f", "content": "125"}
  assert anthropic_messages(error + [result], ("t1",))[1] == [{"role": "user", "content": [
      {"type": "tool_result", "content": "125", "tool_use_id": "t1"},
      {"type": "text", "text": error[0]["content"]}]}]  # (results first, as Anthropic's)
  body = MessagesBody(model="m", max_tokens=8, messages=[
      {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<tool_call>{"},
      *anthropic_messages(error)[1]])
  assert chat_messages(body)[0][-1] == {"role": "user", "content": error[0]["content"]}


def accumulate(events: list[str]) -> list[dict]:
  """The content blocks a client builds from a stream's events."""
  blocks, json_parts = [], {}
  for event in events:
    kind, data = event.split("\n")[:2]
    data = json.loads(data[len("data: "):])
    assert kind == f"event: {data['type']}"
    if data["type"] == "content_block_start":
      assert data["index"] == len(blocks)
      blocks.append(dict(data["content_block"]))
    elif data["type"] == "content_block_delta":
      delta = data["delta"]
      if delta["type"] == "text_delta":
        blocks[data["index"]]["text"] += delta["text"]
      else:
        json_parts[data["index"]] = json_parts.get(data["index"], "") + delta["partial_json"]
  for i, text in json_parts.items():
    blocks[i]["input"] = json.loads(text)
  return blocks


@pytest.mark.parametrize("output", [
    "Hi there!", "", "Let me see. " + MEMORISED[0][2], MEMORISED[0][2] * 2,
    "A" + MEMORISED[0][2] + " and B", "<tool_call>{broken</tool_call>"])
def test_a_stream_builds_the_blocks_of_the_answer(output, tokenizer):
  """Whatever the model wrote, the blocks a stream's events build are the answer's."""
  turn = finished_turn(tokenizer, output, kind="messages", id_prefix="toolu")

  async def events():
    return [e async for e in stream_events(turn, "m")]

  streamed = asyncio.run(events())
  answer = message_body(turn, "m")
  assert accumulate(streamed) == answer["content"]
  assert json.loads(streamed[-2].split("\n")[1][6:])["delta"]["stop_reason"] == \
      answer["stop_reason"]


def test_a_turn_cut_by_the_context_says_so_not_max_tokens(tokenizer):
  """A turn that reached the context's end before max_tokens said max_tokens (red team
  24); Anthropic's API says model_context_window_exceeded."""
  from rollout_server.anthropic_api import stop_reason

  def turn(n_out, budget):
    return finished_turn(tokenizer, "a" * n_out, "length", budget, kind="messages",
                         id_prefix="toolu")

  assert stop_reason(turn(4, 4)) == "max_tokens"
  assert stop_reason(turn(4, 700)) == "model_context_window_exceeded"


def test_a_turn_cut_at_max_tokens_is_max_tokens_though_its_text_parses_as_a_call(tokenizer):
  """A turn cut by max_tokens right after text that parses as a whole tool call is still
  max_tokens, not tool_use: the policy never stopped, and an agent told tool_use runs a
  call the model might have gone on to change."""
  from rollout_server.anthropic_api import stop_reason
  output = MEMORISED[0][2]
  turn = finished_turn(tokenizer, output, "length", len(tokenizer.encode(output)),
                       kind="messages", id_prefix="toolu")
  assert stop_reason(turn) == "max_tokens"


def claude(url: str, session_id=None) -> anthropic.Anthropic:
  headers = {"X-Session-Id": session_id} if session_id else None
  return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0,
                             default_headers=headers)


def test_a_message_renders_as_the_openai_route_does(server, tokenizer):
  srv, _ = server
  messages, _, answer = MEMORISED[1]
  raw = claude(srv.url).messages.with_raw_response.create(
      model="tiny", max_tokens=30, extra_body=GREEDY, messages=messages)
  msg = raw.parse()
  assert msg.type == "message" and msg.role == "assistant" and msg.model == "tiny"
  assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == answer
  assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
  ids = raw.http_response.json()["jaxagent"]
  assert ids["prompt_ids"] == tokenizer.apply_chat_template(messages)
  assert msg.usage.input_tokens == len(ids["prompt_ids"])
  assert msg.usage.output_tokens == len(ids["output_ids"]) == len(ids["output_logprobs"])
  assert set(ids["versions"]) == {3}
  # A string system prompt and one of text blocks are the OpenAI route's system message.
  blocks = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]
  for system in ("Be brief.", blocks):
    raw = claude(srv.url).messages.with_raw_response.create(
        model="tiny", max_tokens=1, system=system, messages=messages)
    assert raw.http_response.json()["jaxagent"]["prompt_ids"] == tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}] + messages)
  # A length cut is max_tokens.
  assert claude(srv.url).messages.create(model="tiny", max_tokens=2, extra_body=GREEDY,
                                         messages=messages).stop_reason == "max_tokens"


def test_tool_use_round_trip_is_recorded_token_exactly(server, tokenizer):
  srv, _ = server
  client = claude(srv.url, session_id="claude-1")
  messages = MEMORISED[0][0]
  first = client.messages.with_raw_response.create(model="tiny", max_tokens=100, extra_body=GREEDY,
                                                   tools=CALCULATE, messages=messages)
  msg = first.parse()
  assert msg.stop_reason == "tool_use"
  (use,) = msg.content  # no text before the call
  assert use.type == "tool_use" and use.name == "calculate" and use.id.startswith("toolu_")
  assert use.input == {"expression": "2+3"}
  # The agent answers with the client's own content blocks and a tool result.
  follow = messages + [{"role": "assistant", "content": msg.content},
                       {"role": "user", "content": [
                           {"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]
  second = client.messages.with_raw_response.create(model="tiny", max_tokens=5, extra_body=GREEDY,
                                                    tools=CALCULATE, messages=follow)
  answers = [first.http_response.json()["jaxagent"], second.http_response.json()["jaxagent"]]
  # The same chat through the OpenAI route's shapes renders to the same tokens.
  call = {"id": use.id, "type": "function",
          "function": {"name": "calculate", "arguments": json.dumps(use.input)}}
  openai_follow = messages + [{"role": "assistant", "content": "", "tool_calls": [call]},
                              {"role": "tool", "tool_call_id": use.id, "content": "5"}]
  assert answers[1]["prompt_ids"] == tokenizer.apply_chat_template(openai_follow, tools=TOOLS)

  turns = httpx.get(f"{srv.url}/sessions/claude-1").json()["turns"]
  assert [t["turn"] for t in turns] == [0, 1] and turns[0]["kind"] == "messages"
  for turn, answer in zip(turns, answers):  # the record is what the engine sampled
    for key in ("prompt_ids", "output_ids", "output_logprobs", "versions"):
      assert turn[key] == answer[key], key
  assert turns[0]["response"]["tool_calls"][0]["id"] == use.id
  # The sampled call stays in the next prompt token for token: one clean segment whose
  # trained tokens and log-probs are the two answers'.
  assert answers[1]["prompt_ids"][:len(answers[0]["prompt_ids"]) + len(answers[0]["output_ids"])] \
      == answers[0]["prompt_ids"] + answers[0]["output_ids"]
  (seg,) = collect_session(turns, session_id="claude-1", task_id="t")
  assert seg.decisions == [CLEAN, CLEAN]
  mask = seg.loss_mask > 0
  assert seg.tokens[mask].tolist() == answers[0]["output_ids"] + answers[1]["output_ids"]
  assert seg.rollout_logp[mask].tolist() == pytest.approx(
      answers[0]["output_logprobs"] + answers[1]["output_logprobs"])


def test_streams(server):
  srv, _ = server
  client = claude(srv.url)
  messages, _, answer = MEMORISED[1]
  with client.messages.stream(model="tiny", max_tokens=40, extra_body=GREEDY,
                              messages=messages) as stream:
    text = "".join(stream.text_stream)
    final = stream.get_final_message()
  assert text == answer and final.content[0].text == answer
  assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0
  with client.messages.stream(model="tiny", max_tokens=100, extra_body=GREEDY, tools=CALCULATE,
                              messages=MEMORISED[0][0]) as stream:
    final = stream.get_final_message()
  (use,) = final.content
  assert use.type == "tool_use" and use.input == {"expression": "2+3"}
  assert final.stop_reason == "tool_use"
  # The raw events, in Anthropic's order.
  events = [e.type for e in client.messages.create(model="tiny", max_tokens=100, extra_body=GREEDY,
                                                   tools=CALCULATE, messages=MEMORISED[0][0],
                                                   stream=True)]
  assert events == ["message_start", "content_block_start", "content_block_delta",
                    "content_block_stop", "message_delta", "message_stop"]


def test_bad_requests_get_anthropic_errors_naming_the_field(server):
  srv, _ = server
  c = httpx.Client(base_url=srv.url, timeout=60)
  user = [{"role": "user", "content": "x"}]
  ok = {"model": "tiny", "max_tokens": 4, "messages": user}
  cases = [
      ({"model": "tiny", "messages": user}, 422, "max_tokens"),
      (dict(ok, max_tokens=0), 422, "max_tokens"),
      (dict(ok, messages=[]), 422, "messages"),
      (dict(ok, messages=[{"role": "system", "content": "x"}]), 422, "messages.0.role"),
      (dict(ok, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), 422,
       "messages.0.content"),
      (dict(ok, temperature=-1), 422, "temperature"),
      (dict(ok, tools=[{"name": "f"}]), 422, "tools.0.input_schema"),
      (dict(ok, stop_sequences=["\n"]), 400, "stop_sequences"),
      (dict(ok, thinking={"type": "enabled", "budget_tokens": 1024}), 400, "thinking: not"),
      # (a reviewer: the route ends on the template's stop tokens alone; ignored before)
      (dict(ok, stop_token_ids=[5]), 400, "stop_token_ids: not served"),
      (dict(ok, tool_choice={"type": "any"}), 400, "tool_choice"),
      (dict(ok, tool_choice={"type": "auto", "disable_parallel_tool_use": True}), 400,
       "tool_choice.disable_parallel_tool_use: not supported"),
      (dict(ok, messages=user + [{"role": "assistant", "content": "Su"}]), 400, "messages.1"),
      (dict(ok, messages=user + [{"role": "assistant", "content": [
          {"type": "tool_result", "tool_use_id": "a", "content": "x"}]}] + user), 400,
       "messages.1.content.0"),
      (dict(ok, messages=[{"role": "user", "content": "x" * 600}]), 400, "max_prefill_length"),
      # A tool result must answer a tool use of the assistant message before (Anthropic's
      # API refuses one that does not; it was served).
      (dict(ok, messages=[{"role": "user", "content": [
          {"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]), 400,
       "messages.0.content.0: tool_result for tool_use_id 'nope', which the assistant "
       "message before did not call (it called no tool)"),
      (dict(ok, messages=user + [{"role": "assistant", "content": [
          {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
          {"role": "user", "content": [
              {"type": "tool_result", "tool_use_id": "t2", "content": "x"}]}]), 400,
       "(it called 't1')"),
      # (red team 24: an empty turn was served as no turn; a lone surrogate in the model's
      # name was sampled and recorded, then answered with an encoder's 400; a NaN in a
      # schema was recorded, and the session's record could not be read again)
      (dict(ok, messages=[{"role": "user", "content": []}]), 400, "messages.0.content: empty"),
      (dict(ok, messages=user + [{"role": "user", "content": [{"type": "text", "text": ""}]}]),
       400, "messages.1.content: empty"),
      (dict(ok, model="a\udcff"), 422, "model: Value error, not valid Unicode"),
      (dict(ok, tools=[{"name": "f", "input_schema": {"default": float("nan")}}]), 400,
       "body: NaN is not plain JSON"),
      (dict(ok, temperature=float("inf")), 400, "body: Infinity is not plain JSON"),
  ]
  for body, status, needle in cases:  # (as json.dumps writes them: NaN, escapes)
    r = c.post("/v1/messages", content=json.dumps(body),
               headers={"content-type": "application/json"})
    assert r.status_code == status, (body, r.status_code, r.text)
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert needle in error["error"]["message"], (needle, error)
  r = c.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
  assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
  # The client raises its own typed errors with the message.
  with pytest.raises(anthropic.BadRequestError, match="stop_sequences"):
    claude(srv.url).messages.create(model="tiny", max_tokens=4, messages=user,
                                    stop_sequences=["\n"])
  assert c.get("/health").json()["status"] == "ok"


def test_through_the_router(server):
  srv, _ = server
  with ServerThread(create_router([srv.url], health_interval_s=600)) as router:
    client = claude(router.url, session_id="routed-1")
    raw = client.messages.with_raw_response.create(
        model="tiny", max_tokens=100, extra_body=GREEDY, tools=CALCULATE,
        messages=MEMORISED[0][0])
    assert raw.http_response.headers["x-routed-to"] == srv.url
    assert raw.parse().stop_reason == "tool_use"
    with client.messages.stream(model="tiny", max_tokens=40, extra_body=GREEDY,
                                messages=MEMORISED[1][0]) as stream:
      assert stream.get_final_message().content[0].text == MEMORISED[1][2]
    # The router's copy of the session: both turns (the stream's too), as sampled.
    answer = raw.http_response.json()["jaxagent"]
    turns = httpx.get(f"{router.url}/sessions/routed-1").json()["turns"]
    assert [t["turn"] for t in turns] == [0, 1] and turns[0]["kind"] == "messages"
    assert turns[0]["output_ids"] == answer["output_ids"]
    assert turns[0]["output_logprobs"] == answer["output_logprobs"]
    with pytest.raises(anthropic.UnprocessableEntityError, match="max_tokens"):
      client.messages.create(model="tiny", max_tokens=0, messages=MEMORISED[1][0])


def test_a_stream_cut_by_a_dying_backend_ends_with_an_anthropic_error():
  backend = FastAPI()

  @backend.post("/v1/messages")
  async def dies_mid_stream():
    async def events():
      yield 'event: message_start\ndata: {"type": "message_start", "message": {}}\n\n'
      raise RuntimeError("the backend dies")  # the connection is cut mid-body

    return StreamingResponse(events(), media_type="text/event-stream")

  with ServerThread(backend) as dying, \
      ServerThread(create_router([dying.url], health_interval_s=600)) as router:
    with pytest.raises(anthropic.APIStatusError, match="went away mid-stream") as e:
      with claude(router.url).messages.stream(model="tiny", max_tokens=3,
                                              messages=MEMORISED[1][0]) as stream:
        stream.get_final_message()
    assert e.value.body["error"]["type"] == "api_error"


class MemorisedToolEnv(Env):
  """The memorised tool question; passes once a `calculate` call has run. A turn without a
  tool call ends the episode."""

  name = "memorised_tool"

  def __init__(self):
    super().__init__()
    schema = TOOLS[0]["function"]
    self.tools = ToolSet([Tool(schema["name"], schema["description"], schema["parameters"],
                               lambda expression: str(safe_eval(expression)))])

  async def reset(self, task):
    return Observation(list(MEMORISED[0][0]), TOOLS)

  async def step(self, action):
    run = await self.tools.run_turn(self, action)
    self.done = not run.messages  # no tool call: the final answer
    return StepResult(Observation(run.messages), 0.0, self.done, False, self._info())

  async def verify(self):
    # (the calls that ran: a malformed block is a call too, an invalid one)
    ok = self.counters["tool_calls"] - self.counters["invalid_tool_calls"] == 1
    return Verdict(VerdictStatus.PASS if ok else VerdictStatus.FAIL, float(ok),
                   f"{self.name}@1", f"{self.name}@1", {})


@pytest.mark.parametrize("api", ["anthropic", "responses"])
def test_blackbox_client_agent_uses_a_tool_through_the_gateway(api, server, tokenizer):
  """The agent's tool_use (a function_call, through the Responses API) goes to the
  environment, its result back as a tool_result (a function_call_output); the trajectory,
  read back from the server, holds both turns token for token."""
  srv, _ = server
  ep = asyncio.run(run_blackbox(MemorisedToolEnv(), TaskSpec("t", "memorised_tool"), srv.url,
                                AgentConfig(max_turns=2, max_new_tokens=100, temperature=0.0),
                                session_id=f"{api}-bb", group_id="g", api=api))
  assert not ep.infra_error, ep.reason
  assert ep.success and ep.turns == 2
  (seg,) = ep.segments
  assert seg.session_id == f"{api}-bb" and seg.decisions == [CLEAN, CLEAN]
  assert set(seg.versions[seg.loss_mask > 0].tolist()) == {3}
  first_turn = seg.tokens[(seg.loss_mask > 0) & (seg.turn_ids == 0)].tolist()
  assert tokenizer.decode(first_turn) == MEMORISED[0][2] + "<|im_end|>"
  # The tool's result is in the second turn's context, as a tool turn.
  assert "<|im_start|>tool\n5<|im_end|>" in tokenizer.decode(seg.tokens.tolist())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["anthropic", "responses"])
def test_training_with_a_client_agent(kind, tmp_path):
  """Two training steps whose episodes an `anthropic`-client agent (or one written
  against the `openai` client's Responses API) plays through the gateway; their
  trajectories are the server's session records."""
  run_dir = str(tmp_path / "run")
  proc = subprocess.run(
      [sys.executable, "-m", "jaxagent.train", "--config", "configs/tiny.yaml", "--run-dir",
       run_dir, "steps=2", f"agent.kind={kind}", "agent.max_turns=2",
       "rollout.groups_per_step=2", "rollout.group_size=2", "data.rows=4",
       "serving.engine.slots=4", "checkpoint.every_steps=0", "checkpoint.export_every=0",
       "checkpoint.wal=false"],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows] == [1, 2] and rows[-1]["policy_version"] == 2
  assert all(r["action_tokens"] > 0 for r in rows)
  segs = list(read_jsonl(os.path.join(run_dir, "trajectories.jsonl.gz")))
  assert segs and "<|im_start|>assistant" in segs[0]["text"]
  for seg in segs:  # the sampled tokens, with the engine's log-probs and versions
    sampled = [i for i, m in enumerate(seg["loss_mask"]) if m]
    assert sampled and all(seg["rollout_logp"][i] <= 0 for i in sampled)
    assert {seg["versions"][i] for i in sampled} <= {0, 1}
  assert any(lp < 0 for seg in segs for lp in seg["rollout_logp"])
