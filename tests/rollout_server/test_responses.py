"""OpenAI's Responses API (`POST /v1/responses`) against real servers on loopback ports,
through the official `openai` client: input items, a function-call round trip recorded
token-exactly, previous_response_id, streams (as the client's own accumulator builds
them), errors naming the field, the router. (A black-box agent written against
`client.responses` plays and trains in test_anthropic.py's client-agent tests.)"""

import asyncio
import json
import time

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from envs.calculator import EXAMPLES, SYSTEM
from jaxagent.blackbox import collect_session, response_items
from jaxagent.tokenizer import clean_unicode
from jaxagent.trajectory import CLEAN
from rollout_server.responses_api import (RelayedResponses, ResponsesBody, ResponseStore,
                                          StreamEnd, chat_messages, echo, made_whole,
                                          response_body, stream_events)
from rollout_server.router import create_router
from rollout_server.serving import ServerThread
from tests.rollout_server.conftest import MEMORISED, TOOLS, finished_turn

GREEDY = {"temperature": 0}
# The conftest's tool as a Responses function tool: it renders to the same prompt.
CALCULATE = [{"type": "function", "name": t["function"]["name"],
              "description": t["function"]["description"],
              "parameters": t["function"]["parameters"], "strict": False} for t in TOOLS]


def continues(a: dict, b: dict) -> bool:
  """Whether response `b`'s prompt starts with response `a`'s prompt and output tokens."""
  context = a["jaxagent"]["prompt_ids"] + a["jaxagent"]["output_ids"]
  return b["jaxagent"]["prompt_ids"][:len(context)] == context


def body(**kw) -> ResponsesBody:
  return ResponsesBody.model_validate({"model": "m", **kw})


def test_items_convert_to_the_chat_form_by_hand():
  got, kept, tools = chat_messages(body(
      instructions="Be brief.", tools=CALCULATE[:1] + [{"type": "function", "name": "g"}],
      input=[
          {"role": "developer", "content": "Rules."},
          {"role": "user", "content": [{"type": "input_text", "text": "Hi "},
                                       {"type": "input_text", "text": "there"}]},
          # (a reply as the client hands it back: its message, then its two calls)
          {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
           "content": [{"type": "output_text", "text": "Two calls.", "annotations": [],
                        "logprobs": []}]},
          {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "calculate",
           "arguments": '{"expression": "1+1"}', "status": "completed"},
          {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
          {"type": "function_call_output", "call_id": "c1", "output": "2"},
          {"type": "function_call_output", "call_id": "c2",
           "output": [{"type": "input_text", "text": "o"}, {"type": "input_text", "text": "k"}]},
          {"type": "message", "role": "user", "content": "Go on."}]))
  assert tools == TOOLS + [{"type": "function", "function": {"name": "g"}}]
  assert got == [
      {"role": "system", "content": "Be brief."},
      {"role": "system", "content": "Rules."},
      {"role": "user", "content": "Hi there"},
      {"role": "assistant", "content": "Two calls.", "tool_calls": [
          {"id": "c1", "type": "function",
           "function": {"name": "calculate", "arguments": '{"expression": "1+1"}'}},
          {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "2"},
      {"role": "tool", "tool_call_id": "c2", "content": "ok"},
      {"role": "user", "content": "Go on."}]
  assert kept == got[1:]  # (the instructions are the call's own, not the conversation's)
  # A string input is one user message; calls alone make an assistant message.
  assert chat_messages(body(input="Hi"))[0] == [{"role": "user", "content": "Hi"}]
  assert chat_messages(body(input=[
      {"role": "user", "content": "a"},
      {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
      {"type": "function_call_output", "call_id": "c", "output": "r"}]))[0][1] == {
          "role": "assistant", "content": "", "tool_calls": [
              {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def test_a_reply_whose_outputs_came_between_its_calls_is_one_turn():
  """[call 1, output 1, call 2, output 2] (as OpenAI's guide writes them) of one reply is
  that reply, told by the call ids this server gave: as two turns it was encoded anew,
  a fork at every multi-call turn (a reviewer's finding). Other ids: as sent."""
  def items(a, b):
    return [{"role": "user", "content": "u"},
            {"role": "assistant", "content": "Two."},
            {"type": "function_call", "call_id": a, "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": a, "output": "1"},
            {"type": "function_call", "call_id": b, "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": b, "output": "2"}]

  ours = ["call_req-7-0a1b2c3d_0", "call_req-7-0a1b2c3d_1"]
  interleaved = chat_messages(body(input=items(*ours)))[0]
  grouped = chat_messages(body(input=[items(*ours)[i] for i in (0, 1, 2, 4, 3, 5)]))[0]
  assert interleaved == grouped
  assert [m["role"] for m in interleaved] == ["user", "assistant", "tool", "tool"]
  assert [m["role"] for m in chat_messages(body(input=items("c1", "c2")))[0]] == [
      "user", "assistant", "tool", "assistant", "tool"]
  # (a later reply's call, its own ids, starts its own turn)
  later = items(ours[0], "call_req-8-0a1b2c3d_0")
  assert [m["role"] for m in chat_messages(body(input=later))[0]] == [
      "user", "assistant", "tool", "assistant", "tool"]
  # Two message items are two messages, as the chat route renders them.
  assert chat_messages(body(input=[{"role": "assistant", "content": "x"},
                                   {"role": "assistant", "content": "y"},
                                   {"role": "user", "content": "z"}]))[0] == [
      {"role": "assistant", "content": "x"}, {"role": "assistant", "content": "y"},
      {"role": "user", "content": "z"}]


def test_a_reply_that_opens_the_input_still_gathers_its_interleaved_calls():
  """A reply that is the input's first item (no user message before it: a conversation
  the assistant opened) is still the call's own reply: its calls with this server's ids,
  their outputs between them, are one turn. Read as the prior conversation's (the reply
  at the input's start taken for the part before), the second call started a new
  assistant turn: a fork in the recorded tokens at every multi-call turn."""
  ours = ["call_req-7-0a1b2c3d_0", "call_req-7-0a1b2c3d_1"]
  items = [{"role": "assistant", "content": "Two."}]
  for i, c in enumerate(ours):
    items += [{"type": "function_call", "call_id": c, "name": "f", "arguments": "{}"},
              {"type": "function_call_output", "call_id": c, "output": str(i)}]
  got = chat_messages(body(input=items))[0]
  assert [m["role"] for m in got] == ["assistant", "tool", "tool"]
  assert [c["id"] for c in got[0]["tool_calls"]] == ours


def test_call_ids_of_the_servers_form_only_with_a_numbered_tail_join_a_reply():
  """Only `call_{request id}_{i}` (a number last) is an id this server gave; a client's
  own ids that merely start with `call_` and hold an underscore (`call_x_a`, `call_x_b`)
  are as sent: two turns. Taken for ours, the client's two separate replies were merged
  into one, a turn the policy never sampled recorded for training."""
  items = []
  for c in ("call_x_a", "call_x_b"):
    items += [{"type": "function_call", "call_id": c, "name": "f", "arguments": "{}"},
              {"type": "function_call_output", "call_id": c, "output": "r"}]
  got = chat_messages(body(input=[{"role": "user", "content": "u"}] + items))[0]
  assert [m["role"] for m in got] == ["user", "assistant", "tool", "assistant", "tool"]


def test_a_made_whole_field_whose_parts_miscount_the_input_is_refused():
  """The parts of a router's call made whole must count the input's items exactly: parts
  that do not would be read as response boundaries in the wrong places (items joining the
  wrong response's turn), silently; they are refused instead."""
  two = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
  for parts in ([1, 2], [1], [3, -1], [1, 1.0]):
    with pytest.raises(ValueError, match="jaxagent_made_whole: not a router's call"):
      made_whole(body(input=two, jaxagent_made_whole={"previous_response_id": "r",
                                                      "parts": parts}))
  assert made_whole(body(input=two, jaxagent_made_whole={
      "previous_response_id": "r", "parts": [1, 1]})) == ("r", [1, 1])


def test_an_environment_chat_renders_alike_through_every_gateway(tokenizer):
  """The calculator's worked examples (OpenAI's chat shape), put in the Responses API's
  items by the agent and back by the server, render to the same tokens."""
  chat = [{"role": "system", "content": SYSTEM}] + list(EXAMPLES) + [
      {"role": "user", "content": "What is 6 * 7?"}]
  instructions, items = response_items(chat)
  back, _, tools = chat_messages(body(instructions=instructions, input=items, tools=CALCULATE))
  assert tools == TOOLS
  assert tokenizer.apply_chat_template(back, tools) == tokenizer.apply_chat_template(chat, TOOLS)


def test_a_tool_message_that_answers_no_call_is_text():
  """The environment's error for a malformed call (no call in the reply, no id) goes as a
  user message; a result answers the reply's call by its position."""
  error = {"role": "tool", "content": "error: malformed tool call: bad JSON"}
  result = {"role": "tool", "tool_call_id": "env_1", "name": "f", "content": "125"}
  assert response_items([error, result], ("c1",))[1] == [
      {"role": "user", "content": error["content"]},
      {"type": "function_call_output", "call_id": "c1", "output": "125"}]
  # A step's system message is an item (the first messages' lead the instructions).
  system = {"role": "system", "content": "Hurry."}
  assert response_items([system], first=False) == ("", [system])
  assert response_items([system]) == ("Hurry.", [])


def test_kept_responses_are_steps_of_their_chain():
  store = ResponseStore(max_bytes=10_000)
  store.keep("r1", None, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
  store.keep("r2", "r1", [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}])
  assert [m["content"] for m in store.conversation("r2")] == ["a", "b", "c", "d"]
  assert list(store._kept) == ["r1", "r2"]  # (a chain's newest is evicted last)
  for i in range(60):  # the least recently used go first past the bound
    store.keep(f"x{i}", None, [{"role": "user", "content": "y" * 100}])
  assert store.bytes <= store.max_bytes
  with pytest.raises(KeyError, match="'r2' is not kept"):
    store.conversation("r2")
  store.keep("s1", None, [{"role": "user", "content": "a"}])
  store.keep("s2", "s1", [{"role": "user", "content": "b"}])
  store._kept.pop("s1")
  with pytest.raises(KeyError, match="the response 's1' it continued has gone"):
    store.conversation("s2")


def made_whole_alike(chain: list[tuple[dict, dict]], nxt: dict, stream_end: bool = False):
  """For a chain of calls (request, the server's answer) and a next call: the messages of
  the next call served where the chain is kept, and of it made whole by a router."""
  store, relayed = ResponseStore(), RelayedResponses()
  for request, answer in chain:
    parent = request.get("previous_response_id")
    prior = store.conversation(parent) if parent else []
    _, conversation, _ = chat_messages(ResponsesBody.model_validate(request), prior)
    reply = answer.pop("finish")
    store.keep(answer["id"], parent, conversation[len(prior):] + [reply])
    relayed.learn("http://a", RelayedResponses.step(request), answer)
  assert relayed.home(chain[-1][1]["id"]) == ("http://a", True) and len(relayed) == len(chain)
  whole = relayed.whole(nxt)
  assert "previous_response_id" not in whole
  assert whole["jaxagent_made_whole"]["previous_response_id"] == nxt["previous_response_id"]
  body_ = ResponsesBody.model_validate(whole)
  continued, parts = made_whole(body_)
  assert continued == nxt["previous_response_id"] and echo(body_, "m", continued)[
      "previous_response_id"] == continued
  made, _, _ = chat_messages(body_, parts=parts)
  kept, _, _ = chat_messages(ResponsesBody.model_validate(nxt),
                             store.conversation(nxt["previous_response_id"]))
  return made, kept


@pytest.mark.parametrize("streamed", [False, True])
def test_a_chain_made_whole_is_the_conversation_its_server_kept(tokenizer, streamed):
  """A router's record of a chain (its calls and their responses, learnt from bodies or
  from the streams' last events) made whole is, converted, the conversation the server
  that made it kept: replies with text, with calls, with both, and their outputs."""
  replies = ["Let me see. " + MEMORISED[0][2], MEMORISED[0][2] * 2, "It is 5. Bye."]
  inputs = [[{"role": "user", "content": "What is 2+3?"}], None, "And 4?"]
  chain, parent, answer = [], None, None
  for i, (given, output) in enumerate(zip(inputs, replies)):
    turn = finished_turn(tokenizer, output, kind="responses", request_id=f"r{i}")
    if given is None:  # the outputs of the calls before
      given = [{"type": "function_call_output", "call_id": c["call_id"], "output": "5"}
               for c in answer["output"] if c["type"] == "function_call"]
    request = {"model": "m", "input": given, "instructions": "Be brief.",
               "previous_response_id": parent}
    settings = echo(body(**request), "m")
    answer = response_body(turn, settings, 0, logprobs=True)
    if streamed:
      end = StreamEnd()

      async def events():
        return [e async for e in stream_events(turn, settings, 0)]

      for event in asyncio.run(events()):  # (in pieces that cut events and lines)
        for j in range(0, len(event), 7):
          end.feed(event[j:j + 7].encode())
      assert end.response["output"] == response_body(turn, settings, 0)["output"]
      answer = end.response
    chain.append((request, dict(answer, finish=turn.finish())))
    parent = answer["id"]
  nxt = {"model": "m", "input": "Thanks", "instructions": "Be brief.",
         "previous_response_id": parent, "store": True}
  made, kept = made_whole_alike(chain, nxt)
  assert made == kept and len(made) == 8


def test_a_streams_end_is_read_across_any_cut_and_an_event_past_the_bound_is_dropped():
  """`StreamEnd` searches each chunk once (the event in progress searched again at every
  chunk took 4 s of the router's loop for an 8 MB response), with CRLF or LF ends cut
  anywhere, and drops an event past its bound, reading the next."""
  done = (b'event: response.completed\r\ndata: {"response": {"id": "r", "output": "'
          + b"x" * 5000 + b'"}}\r\n\r\n')
  stream = b"event: response.created\ndata: {}\n\n" + done + b": ping\n\n"
  for size in (1, 2, 3, 5, 4096):
    end = StreamEnd()
    for j in range(0, len(stream), size):
      end.feed(stream[j:j + size])
    assert end.response is not None and end.response["id"] == "r", size
  end = StreamEnd(limit=1000)
  for j in range(0, len(done), 100):
    end.feed(done[j:j + 100])
  assert end.response is None  # (past the bound: not read)
  end.feed(b'event: response.incomplete\ndata: {"response": {"id": "s"}}\n\n')
  assert end.response == {"id": "s"}

def test_a_chain_made_whole_keeps_its_calls_boundaries():
  """Items that would join the response before them when read as one input (a client's
  own call after a reply's text; a call with an id of this server's form after the outputs
  of the reply's calls) stay where the kept conversation has them: the router sends where
  each response's items begin (red team 40: the rendered prompt lost a reply's end)."""
  text = {"type": "message", "role": "assistant",
          "content": [{"type": "output_text", "text": "Hi there!"}]}
  said = [({"input": "Say hi"}, {"id": "resp_1", "output": [text], "store": True,
                                 "finish": {"role": "assistant", "content": "Hi there!"}})]
  own_call = {"previous_response_id": "resp_1", "input": [
      {"type": "function_call", "call_id": "call_mine", "name": "calc", "arguments": "{}"},
      {"type": "function_call_output", "call_id": "call_mine", "output": "7"},
      {"role": "user", "content": "and?"}]}
  made, kept = made_whole_alike(said, own_call)
  assert made == kept and [m["role"] for m in made] == ["user", "assistant", "assistant",
                                                         "tool", "user"]
  call = {"type": "function_call", "call_id": "call_req-1-ab_0", "name": "calc",
          "arguments": "{}"}
  called = [({"input": "What is 2+3?"}, {"id": "resp_1", "output": [call], "finish": {
      "role": "assistant", "content": "", "tool_calls": [{"id": "call_req-1-ab_0",
      "type": "function", "function": {"name": "calc", "arguments": "{}"}}]}})]
  interleaved = {"previous_response_id": "resp_1", "input": [
      {"type": "function_call_output", "call_id": "call_req-1-ab_0", "output": "5"},
      dict(call, call_id="call_req-1-ab_1"),
      {"type": "function_call_output", "call_id": "call_req-1-ab_1", "output": "6"}]}
  made, kept = made_whole_alike(called, interleaved)
  assert made == kept and [m["role"] for m in made] == ["user", "assistant", "tool",
                                                         "assistant", "tool"]


def test_what_a_router_keeps_of_responses_is_bounded_and_only_what_was_kept():
  relayed = RelayedResponses(max_bytes=20_000)
  answer = {"id": "resp_1", "output": [], "store": True}
  # Not kept where it was made (the response's store, as its server read the call's), or
  # no response: none.
  for store in (False, 0, "false", "no", True):
    relayed.learn("a", RelayedResponses.step({"input": "x", "store": store}),
                  dict(answer, store=False))
  relayed.learn("a", RelayedResponses.step({"input": 5}), answer)
  relayed.learn("a", RelayedResponses.step({"input": "x"}), {"id": "resp_y", "output": "junk"})
  relayed.learn("a", RelayedResponses.step({"input": "x"}), ["junk"])
  assert len(relayed) == 0
  # What a client adds to its items beyond a conversation's fields is not kept: the bound
  # is of what is (red team 40: 4 MiB calls of nested junk held 1 GiB).
  junk = {"role": "user", "content": "hi", "x": [{}] * 100_000}
  relayed.learn("a", RelayedResponses.step({"input": [junk]}), answer)
  assert relayed.bytes < 1_000 and relayed.whole(
      {"previous_response_id": "resp_1", "input": "y"})["input"][0] == {
          "role": "user", "content": "hi"}
  for i in range(100):  # the least recently used go first past the bound
    relayed.learn("a", RelayedResponses.step({"input": "z" * 1000}), dict(answer, id=f"r{i}"))
  assert relayed.bytes <= relayed.max_bytes and relayed.home("resp_1") == (None, False)
  # A call that is none to make whole (its input no items; its chain not here): none.
  for call in ({"previous_response_id": "r99", "input": 5},
               {"previous_response_id": "r99", "input": {"a": 1}},
               {"previous_response_id": "resp_1", "input": "y"}):
    assert relayed.whole(call) is None


def test_a_chain_in_use_outlives_idle_responses_in_a_routers_record():
  """A live chain's first responses were the first a router's record dropped (only a
  failure walked the chain), so at its home's death it could not be made whole while
  idle one-call responses stayed (a reviewer). A chain used is the most recently used."""
  relayed = RelayedResponses(max_bytes=12_000)
  answer = {"store": True, "output": [{"type": "message", "content": [
      {"type": "output_text", "text": "ok"}]}]}
  parent = None
  for t in range(12):
    relayed.learn("http://a", RelayedResponses.step(
        {"input": "x" * 200, "previous_response_id": parent}), dict(answer, id=f"c{t}"))
    for k in range(2):  # (others' one-call responses between the chain's calls)
      relayed.learn("http://b", RelayedResponses.step({"input": "y" * 200}),
                    dict(answer, id=f"o{t}_{k}"))
    assert relayed.home(f"c{t}") == ("http://a", True)
    parent = f"c{t}"
  assert relayed.bytes <= relayed.max_bytes and relayed.home("o0_0") == (None, False)
  whole = relayed.whole({"previous_response_id": "c11", "input": "next"})
  assert whole["jaxagent_made_whole"]["parts"] == [1, 1] * 12 + [1]
  # A chain whose first response has gone is none to make whole, though its home is known.
  relayed.bytes -= relayed._kept.pop("c0").nbytes
  assert relayed.home("c11") == ("http://a", False) and relayed.whole(
      {"previous_response_id": "c11", "input": "next"}) is None


def accumulate(events: list[str]) -> tuple[list[dict], dict]:
  """The output items a client builds from a stream's events, and the final response."""
  items, final, seq = [], None, []
  for event in events:
    kind, data = event.split("\n")[:2]
    data = json.loads(data[len("data: "):])
    assert kind == f"event: {data['type']}"
    seq.append(data["sequence_number"])
    if data["type"] == "response.output_item.added":
      assert data["output_index"] == len(items)
      items.append(dict(data["item"]))
    elif data["type"] == "response.content_part.added":
      items[data["output_index"]]["content"].append(dict(data["part"]))
    elif data["type"] == "response.output_text.delta":
      items[data["output_index"]]["content"][data["content_index"]]["text"] += data["delta"]
    elif data["type"] == "response.function_call_arguments.delta":
      items[data["output_index"]]["arguments"] += data["delta"]
    elif data["type"] == "response.output_item.done":
      assert items[data["output_index"]]["type"] == data["item"]["type"]
      built = items[data["output_index"]]
      if built["type"] == "message":
        assert built["content"][0]["text"] == data["item"]["content"][0]["text"]
      else:
        assert built["arguments"] == data["item"]["arguments"]
      items[data["output_index"]] = data["item"]
    elif data["type"] in ("response.completed", "response.incomplete"):
      final = data["response"]
  assert seq == list(range(len(events)))
  return items, final


@pytest.mark.parametrize("output", [
    "Hi there!", "", "Let me see. " + MEMORISED[0][2], MEMORISED[0][2] * 2,
    "A" + MEMORISED[0][2] + " and B", "<tool_call>{broken</tool_call>"])
def test_a_stream_builds_the_items_of_the_answer(output, tokenizer):
  """Whatever the model wrote, the items a stream's events build are the answer's."""
  turn = finished_turn(tokenizer, output, kind="responses")
  settings = echo(body(input="x"), "m")

  async def events():
    return [e async for e in stream_events(turn, settings, 0)]

  items, final = accumulate(asyncio.run(events()))
  answer = response_body(turn, settings, 0)
  assert items == answer["output"] == final["output"]
  assert final["status"] == answer["status"] == "completed"


def test_a_cut_turn_says_which_budget_ran_out(tokenizer):
  full = response_body(finished_turn(tokenizer, "aaaa", "length", budget=4), {}, 0)
  assert full["status"] == "incomplete"
  assert full["incomplete_details"] == {"reason": "max_output_tokens"}
  context = response_body(finished_turn(tokenizer, "aaaa", "length", budget=700), {}, 0)
  assert context["incomplete_details"] == {"reason": "context_window_exceeded"}


def test_a_stream_of_a_cut_turn_ends_with_response_incomplete(tokenizer):
  """A turn cut at max_output_tokens streams to `response.incomplete` (its response
  incomplete, saying which budget ran out), as OpenAI's API ends it: ended with
  `response.completed`, a streaming agent took a cut answer for a finished one."""
  turn = finished_turn(tokenizer, "aaaa", "length", budget=4, kind="responses")

  async def events():
    return [e async for e in stream_events(turn, echo(body(input="x"), "m"), 0)]

  last = asyncio.run(events())[-1]
  assert last.startswith("event: response.incomplete\n")
  final = json.loads(last.split("\n")[1][len("data: "):])["response"]
  assert final["status"] == "incomplete"
  assert final["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_responses_usage_counts_its_prompt_and_output_tokens(tokenizer):
  """`usage` is the turn's own token counts: input the prompt's, output the sampled
  tokens' (the stop token too), total their sum. An agent framework budgets and bills its
  runs by these (the openai-agents SDK adds them up): counts swapped or a total without
  the output misreport what each turn cost."""
  turn = finished_turn(tokenizer, "Hi there, a longer answer.", kind="responses")
  got = response_body(turn, {}, 0)["usage"]
  prompt, out = len(turn.prompt_ids), len(turn.output_ids)
  assert prompt != out
  assert (got["input_tokens"], got["output_tokens"], got["total_tokens"]) == (
      prompt, out, prompt + out)


def client(url: str, session_id=None) -> openai.OpenAI:
  headers = {"X-Session-Id": session_id} if session_id else None
  return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                       default_headers=headers)


def test_a_response_renders_as_the_chat_route_does(server, tokenizer):
  srv, _ = server
  messages, _, answer = MEMORISED[1]
  raw = client(srv.url).responses.with_raw_response.create(
      model="tiny", max_output_tokens=30, input=messages[0]["content"], **GREEDY)
  resp = raw.parse()
  assert resp.object == "response" and resp.status == "completed" and resp.model == "tiny"
  assert resp.output_text == answer
  (item,) = resp.output
  assert item.type == "message" and item.role == "assistant" and item.status == "completed"
  ids = raw.http_response.json()["jaxagent"]
  assert ids["prompt_ids"] == tokenizer.apply_chat_template(messages)
  assert resp.usage.input_tokens == len(ids["prompt_ids"])
  assert resp.usage.output_tokens == len(ids["output_ids"]) == len(ids["output_logprobs"])
  assert set(ids["versions"]) == {3}
  # Instructions are the system message; a length cut is incomplete.
  raw = client(srv.url).responses.with_raw_response.create(
      model="tiny", max_output_tokens=1, instructions="Be brief.", input=messages)
  assert raw.http_response.json()["jaxagent"]["prompt_ids"] == tokenizer.apply_chat_template(
      [{"role": "system", "content": "Be brief."}] + messages)
  cut = client(srv.url).responses.create(model="tiny", max_output_tokens=2, input=messages,
                                         **GREEDY)
  assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
  # Each output token's log-prob, when asked for.
  raw = client(srv.url).responses.with_raw_response.create(
      model="tiny", max_output_tokens=30, input=messages,
      include=["message.output_text.logprobs"], **GREEDY)
  lps = raw.parse().output[0].content[0].logprobs
  assert [lp.logprob for lp in lps] == raw.http_response.json()["jaxagent"]["output_logprobs"]
  assert b"".join(bytes(lp.bytes) for lp in lps).decode() == answer + "<|im_end|>"


def test_a_tokens_bytes_are_its_own_not_its_texts(tokenizer):
  """A token that is part of a character has its bytes, not U+FFFD's (a reviewer's)."""
  ids = tokenizer.encode("é")
  assert [tokenizer.token_bytes(t) for t in ids] == [b"\xc3", b"\xa9"]
  assert tokenizer.token_bytes(tokenizer.stop_ids[0]) == b"<|im_end|>"


def test_function_call_round_trip_is_recorded_token_exactly(server, tokenizer):
  srv, _ = server
  c = client(srv.url, session_id="resp-1")
  messages = MEMORISED[0][0]
  first = c.responses.with_raw_response.create(model="tiny", max_output_tokens=100,
                                               tools=CALCULATE, input=messages, **GREEDY)
  resp = first.parse()
  (call,) = resp.output  # no text before the call
  assert call.type == "function_call" and call.name == "calculate"
  assert call.call_id.startswith("call_") and json.loads(call.arguments) == {"expression": "2+3"}
  # The agent hands back the client's own output items and the function's output.
  follow = messages + [o.model_dump(exclude_none=True) for o in resp.output] + [
      {"type": "function_call_output", "call_id": call.call_id, "output": "5"}]
  second = c.responses.with_raw_response.create(model="tiny", max_output_tokens=5,
                                                tools=CALCULATE, input=follow, **GREEDY)
  answers = [first.http_response.json()["jaxagent"], second.http_response.json()["jaxagent"]]
  # The same chat through the chat route's shapes renders to the same tokens.
  chat_call = {"id": call.call_id, "type": "function",
               "function": {"name": "calculate", "arguments": call.arguments}}
  chat_follow = messages + [{"role": "assistant", "content": "", "tool_calls": [chat_call]},
                            {"role": "tool", "tool_call_id": call.call_id, "content": "5"}]
  assert answers[1]["prompt_ids"] == tokenizer.apply_chat_template(chat_follow, tools=TOOLS)
  turns = httpx.get(f"{srv.url}/sessions/resp-1").json()["turns"]
  assert [t["turn"] for t in turns] == [0, 1] and turns[0]["kind"] == "responses"
  for turn, answer in zip(turns, answers):  # the record is what the engine sampled
    for key in ("prompt_ids", "output_ids", "output_logprobs", "versions"):
      assert turn[key] == answer[key], key
  # The sampled call stays in the next prompt token for token: one clean segment.
  assert answers[1]["prompt_ids"][:len(answers[0]["prompt_ids"]) + len(answers[0]["output_ids"])] \
      == answers[0]["prompt_ids"] + answers[0]["output_ids"]
  (seg,) = collect_session(turns, session_id="resp-1", task_id="t")
  assert seg.decisions == [CLEAN, CLEAN]
  mask = seg.loss_mask > 0
  assert seg.tokens[mask].tolist() == answers[0]["output_ids"] + answers[1]["output_ids"]


def test_previous_response_id_continues_the_kept_conversation(server, tokenizer):
  srv, _ = server
  c = client(srv.url, session_id="resp-chain")
  messages = MEMORISED[0][0]
  first = c.responses.create(model="tiny", max_output_tokens=100, tools=CALCULATE,
                             input=messages, instructions="Use the tool.", **GREEDY)
  (call,) = first.output
  raw = c.responses.with_raw_response.create(
      model="tiny", max_output_tokens=5, tools=CALCULATE, previous_response_id=first.id,
      instructions="Use the tool.", **GREEDY,
      input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
  assert raw.parse().previous_response_id == first.id
  whole = [{"role": "system", "content": "Use the tool."}] + messages + [
      {"role": "assistant", "content": "", "tool_calls": [
          {"id": call.call_id, "type": "function",
           "function": {"name": "calculate", "arguments": call.arguments}}]},
      {"role": "tool", "tool_call_id": call.call_id, "content": "5"}]
  second = raw.http_response.json()["jaxagent"]
  assert second["prompt_ids"] == tokenizer.apply_chat_template(whole, tools=TOOLS)
  turns = httpx.get(f"{srv.url}/sessions/resp-chain").json()["turns"]
  assert turns[1]["prompt_ids"][:len(turns[0]["prompt_ids"]) + len(turns[0]["output_ids"])] \
      == turns[0]["prompt_ids"] + turns[0]["output_ids"]
  # One not kept (store: false, or unknown) is a 404 that says why.
  unkept = c.responses.create(model="tiny", max_output_tokens=2, input="Hi", store=False)
  for gone in (unkept.id, "resp_nope"):
    with pytest.raises(openai.NotFoundError, match="is not kept on this server"):
      c.responses.create(model="tiny", max_output_tokens=2, input="Hi",
                         previous_response_id=gone)
  # An answer continued must be answered by what follows it, not by itself.
  with pytest.raises(openai.BadRequestError, match="input: empty"):
    c.responses.create(model="tiny", max_output_tokens=2, input=[],
                       previous_response_id=first.id)


def test_a_call_going_on_from_an_earlier_response_continues_its_tokens(server):
  """An SDK's retry from its last good response, or a branch: a call continuing a
  response that is not the session's last turn (nor the one it went on from) was encoded
  from its text: a fork where the reply's text does not encode back to its tokens (red
  team 41). It continues the tokens of the turn that response was recorded as."""
  srv, _ = server
  http = httpx.Client(base_url=srv.url, headers={"X-Session-Id": "resp-branch"}, timeout=60)
  store = srv.server.config.app.state.sessions

  def ask(text, previous=None):
    r = http.post("/v1/responses", json={"model": "tiny", "input": text, "temperature": 1.0,
                                         "max_output_tokens": 12,
                                         "previous_response_id": previous})
    assert r.status_code == 200, r.text
    return r.json()

  r1 = ask("one")
  r2 = ask("two", r1["id"])
  r3 = ask("three", r2["id"])
  r4 = ask("two again", r1["id"])  # (r1: no thread, nor the turn one went on from)
  # It went on from turn 0's tokens (before, from none: its prompt encoded from the text).
  (went_on,) = [h.parent.turn for h in store._sessions["resp-branch"].heads if h.turn == 3]
  assert went_on == 0
  r5 = ask("three again", r2["id"])
  r6 = ask("four", r3["id"])
  assert all(continues(a, b) for a, b in ((r1, r2), (r2, r3), (r1, r4), (r2, r5), (r3, r6)))
  http.close()


def test_streams(server):
  srv, _ = server
  c = client(srv.url)
  messages, _, answer = MEMORISED[1]
  with c.responses.stream(model="tiny", max_output_tokens=40, input=messages,
                          **GREEDY) as stream:
    deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    final = stream.get_final_response()
  assert deltas == answer == final.output_text and final.status == "completed"
  assert final.usage.output_tokens > 0
  with c.responses.stream(model="tiny", max_output_tokens=100, tools=CALCULATE,
                          input=MEMORISED[0][0], **GREEDY) as stream:
    final = stream.get_final_response()
  (call,) = final.output
  assert call.type == "function_call" and json.loads(call.arguments) == {"expression": "2+3"}
  # The raw events, in the API's order.
  events = [e.type for e in c.responses.create(model="tiny", max_output_tokens=100,
                                               tools=CALCULATE, input=MEMORISED[0][0],
                                               stream=True, **GREEDY)]
  assert events == ["response.created", "response.in_progress",
                    "response.output_item.added", "response.function_call_arguments.delta",
                    "response.function_call_arguments.done", "response.output_item.done",
                    "response.completed"]


def test_bad_requests_get_errors_naming_the_field(server):
  srv, _ = server
  c = httpx.Client(base_url=srv.url, timeout=60)
  ok = {"model": "tiny", "max_output_tokens": 4, "input": "x"}
  call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
  cases = [
      ({"model": "tiny"}, 422, "input: Field required"),
      (dict(ok, max_output_tokens=0), 422, "max_output_tokens"),
      (dict(ok, temperature=-1), 422, "temperature"),
      (dict(ok, input=[]), 400, "input: empty"),
      (dict(ok, input=[{"role": "robot", "content": "x"}]), 400, "input[0].role"),
      (dict(ok, input=[{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]),
       400, "input[0].content[0]: only text parts (input_text) are served, got 'input_image'"),
      (dict(ok, input=[{"type": "reasoning", "id": "rs_1", "summary": []}, "x"]), 400,
       "input[0]: an item of type 'reasoning' is not served"),
      (dict(ok, input=[{"type": "item_reference", "id": "msg_1"}]), 400, "item_reference"),
      (dict(ok, input=["x"]), 400, "input[0]: not an item"),
      (dict(ok, input=[{"role": "user", "content": "x"}, call]), 400,
       "input[1]: the last item must not be the assistant's"),
      (dict(ok, input=[{"type": "function_call_output", "call_id": "c9", "output": "x"}]),
       400, "input[0]: function_call_output for call_id 'c9', which the assistant message "
            "before did not make (it called no function)"),
      (dict(ok, input=[{"role": "user", "content": "x"}, call,
                       {"type": "function_call_output", "call_id": "c2", "output": "x"}]),
       400, "(it called 'c1')"),
      # (a reviewer's: an output twice, or after a message, was taken)
      (dict(ok, input=[{"role": "user", "content": "x"}, call,
                       {"type": "function_call_output", "call_id": "c1", "output": "x"},
                       {"type": "function_call_output", "call_id": "c1", "output": "x"}]),
       400, "input[3]: function_call_output for call_id 'c1', which has its output already"),
      (dict(ok, input=[{"role": "user", "content": "x"}, call, {"role": "user", "content": "y"},
                       {"type": "function_call_output", "call_id": "c1", "output": "x"}]),
       400, "(a message came between them)"),
      (dict(ok, input=[{"type": "function_call", "name": "f", "arguments": "{}"}]), 400,
       "input[0].call_id: Field required"),
      # (named as the chat form's messages[0].tool_calls[0]: a reviewer)
      (dict(ok, input=[{"role": "user", "content": "x"}, dict(call, arguments="{bad"),
                       {"type": "function_call_output", "call_id": "c1", "output": "x"}]),
       400, "input[1].arguments must be the JSON text of an object, got '{bad'"),
      (dict(ok, tools=[{"type": "web_search"}]), 400,
       "tools[0]: only function tools are served, got type 'web_search'"),
      (dict(ok, tools=[{"type": "function"}]), 400, "tools[0].name: Field required"),
      (dict(ok, tool_choice="required"), 400, "tool_choice: only auto"),
      (dict(ok, reasoning={"effort": "high"}), 400, "reasoning: not served"),
      (dict(ok, reasoning={"effort": "none", "summary": "auto"}), 400, "reasoning: not served"),
      # (a red team's: taken and ignored, they were answers the agent did not ask for)
      (dict(ok, parallel_tool_calls=False), 400, "parallel_tool_calls: false is not served"),
      (dict(ok, context_management=[{"type": "compaction", "compact_threshold": 1000}]), 400,
       "context_management: not served"),
      (dict(ok, text={"format": {"type": "json_object"}}), 400, "text.format"),
      (dict(ok, truncation="auto"), 400, "truncation"),
      (dict(ok, conversation="conv_1"), 400, "conversation"),
      (dict(ok, background=True), 400, "background"),
      (dict(ok, top_logprobs=3), 400, "top_logprobs"),
      (dict(ok, logit_bias={"1": 5}), 400, "logit_bias: not served"),
      (dict(ok, input="x" * 600), 400, "max_prefill_length"),
      (dict(ok, model="a\udcff"), 422, "model: Value error, not valid Unicode"),
      (dict(ok, tools=[{"type": "function", "name": "f",
                        "parameters": {"default": float("nan")}}]), 400,
       "body: NaN is not plain JSON"),
  ]
  for req, status, needle in cases:
    r = c.post("/v1/responses", content=json.dumps(req),
               headers={"content-type": "application/json"})
    assert r.status_code == status, (req, r.status_code, r.text)
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and needle in error["message"], (needle, error)
  # Settings that change nothing are taken (and a null is the default).
  r = c.post("/v1/responses", json=dict(ok, store=False, metadata={"k": "v"}, user="u",
                                        parallel_tool_calls=True, temperature=None,
                                        reasoning={"effort": "none"}, truncation="disabled",
                                        include=["reasoning.encrypted_content"],
                                        text={"format": {"type": "text"}, "verbosity": "low"}))
  assert r.status_code == 200, r.text
  # A lone surrogate in what the answer repeats (instructions, metadata, a tool's
  # description) is written as the prompt reads it: its answer was unwritable, a 400 for
  # a turn recorded and kept (a red team's finding).
  r = c.post("/v1/responses", content=json.dumps(dict(
      ok, instructions="a\udfff", metadata={"k": "\udfff"}, user="\udfff", tools=[dict(
          CALCULATE[0], description="d\udfff")])), headers={
              "content-type": "application/json", "x-session-id": "resp-surrogate"})
  assert r.status_code == 200, r.text
  assert r.json()["instructions"] == clean_unicode("a\udfff") != "a\udfff"
  assert r.json()["metadata"] == {"k": clean_unicode("\udfff")}
  (turn,) = httpx.get(f"{srv.url}/sessions/resp-surrogate").json()["turns"]
  assert turn["output_ids"] == r.json()["jaxagent"]["output_ids"]
  with pytest.raises(openai.BadRequestError, match="tool_choice"):
    client(srv.url).responses.create(model="tiny", input="x", tool_choice="required")
  assert c.get("/health").json()["status"] == "ok"


def test_through_the_router(server):
  srv, _ = server
  with ServerThread(create_router([srv.url], health_interval_s=600)) as router:
    c = client(router.url, session_id="resp-routed")
    raw = c.responses.with_raw_response.create(model="tiny", max_output_tokens=100,
                                               tools=CALCULATE, input=MEMORISED[0][0], **GREEDY)
    assert raw.http_response.headers["x-routed-to"] == srv.url
    first = raw.parse()
    assert first.output[0].type == "function_call"
    with c.responses.stream(model="tiny", max_output_tokens=40, input=MEMORISED[1][0],
                            **GREEDY) as stream:
      assert stream.get_final_response().output_text == MEMORISED[1][2]
    # A chain through the router reaches the server that keeps it (the session's).
    c.responses.create(model="tiny", max_output_tokens=2, previous_response_id=first.id,
                       input=[{"type": "function_call_output",
                               "call_id": first.output[0].call_id, "output": "5"}])
    turns = httpx.get(f"{router.url}/sessions/resp-routed").json()["turns"]
    assert [t["turn"] for t in turns] == [0, 1, 2] and turns[0]["kind"] == "responses"
    assert turns[0]["output_ids"] == raw.http_response.json()["jaxagent"]["output_ids"]
    # The router's own refusals are in OpenAI's shape: the client says why (a red team's
    # finding: in FastAPI's shape it said only "Error code: 400").
    with pytest.raises(openai.BadRequestError, match="name different sessions"):
      c.responses.create(model="tiny", input="x", extra_body={"session_id": "another"})
    # A call made whole is the router's to make (a client's claimed any response as the
    # one it continued, echoed as such: a reviewer).
    with pytest.raises(openai.BadRequestError, match="call_id.*at most 256"):
      c.responses.create(model="tiny", input=[
          {"type": "function_call_output", "call_id": "c" * 257, "output": "5"}])
    with pytest.raises(openai.BadRequestError, match="jaxagent_made_whole: set by a router"):
      c.responses.create(model="tiny", input=["x"], extra_body={"jaxagent_made_whole": {
          "previous_response_id": first.id, "parts": [1]}})


def test_a_stream_cut_by_a_dying_backend_raises_in_the_client():
  backend = FastAPI()

  @backend.post("/v1/responses")
  async def dies_mid_stream():
    async def events():
      yield ('event: response.created\ndata: {"type": "response.created", '
             '"sequence_number": 0, "response": {}}\n\n')
      raise RuntimeError("the backend dies")  # the connection is cut mid-body

    return StreamingResponse(events(), media_type="text/event-stream")

  with ServerThread(backend) as dying, \
      ServerThread(create_router([dying.url], health_interval_s=600)) as router:
    with pytest.raises(openai.APIError, match="went away mid-stream"):
      for _ in client(router.url).responses.create(model="tiny", max_output_tokens=3,
                                                   input="x", stream=True):
        pass


def test_a_retry_from_an_earlier_response_goes_where_that_response_was_made(random_params,
                                                                             tokenizer):
  """A session's call going on from a response before its last one, made on a server
  that is not the session's (it served while the session's own was down), went to the
  session's server made whole: handed the last turn (and the one it went on from) only,
  it encoded the earlier reply from its text (a reviewer). It goes to the server that
  made that response, which continues its tokens; the next call, going on from the last
  response, goes home."""
  from rollout_server import routing
  from rollout_server.orchestrator import Orchestrator
  from rollout_server.server import create_app
  from tests.rollout_server.conftest import make_engine

  engine = make_engine()  # (random weights: replies whose text encodes to other tokens)
  orch = Orchestrator(engine, engine.load_params(random_params, version=0)).start()
  apps = [create_app(orch, tokenizer) for _ in range(2)]
  servers = [ServerThread(app).start() for app in apps]
  urls = [s.url for s in servers]
  ring = routing.HashRing(urls)
  sid = next(f"retry-{i}" for i in range(100) if ring.candidates(f"retry-{i}")[0] == urls[0])
  try:
    with ServerThread(create_router(urls, health_interval_s=0.2)) as router:
      http = httpx.Client(base_url=router.url, headers={"X-Session-Id": sid}, timeout=60)

      def ask(text, previous=None, seed=0):
        r = http.post("/v1/responses", json={
            "model": "tiny", "input": text, "temperature": 1.0, "max_output_tokens": 12,
            "previous_response_id": previous, "seed": seed})
        assert r.status_code == 200, r.text
        return r.headers["x-routed-to"], r.json()

      def encodes_back(r):  # (its text's encoding is its tokens: no fork to see)
        text = "".join(p["text"] for item in r["output"] if item["type"] == "message"
                       for p in item["content"])
        out = r["jaxagent"]["output_ids"]
        return tokenizer.encode_plain(text) in (out, out[:-1])

      def healthy(i, up):
        deadline = time.monotonic() + 30
        while http.get("/router/health").json()["backends"][i]["healthy"] != up:
          assert time.monotonic() < deadline
          time.sleep(0.1)

      at1, r1 = ask("one")
      servers[0].stop()
      healthy(0, False)
      for seed in range(40):  # (a reply whose text encodes to other tokens: the fork)
        at2, r2 = ask("two", r1["id"], seed)
        if not encodes_back(r2):
          break
      else:
        raise AssertionError("no reply that its text does not encode back")
      at3, r3 = ask("three", r2["id"])
      at4, r4 = ask("four", r3["id"])
      servers[0] = ServerThread(apps[0], port=servers[0].port).start()
      healthy(0, True)
      # A branch from r2, made on the other server, and not the turn the last one went
      # on from (a handover carries the last turn and that one)
      at5, r5 = ask("two again", r2["id"])
      at6, r6 = ask("five", r5["id"])  # (the last response: home again)
      turns = http.get(f"/sessions/{sid}").json()["turns"]
      http.close()
  finally:
    for s in servers:
      s.stop()
    orch.stop()
  assert [at1, at2, at3, at4, at5, at6] == [urls[0]] + [urls[1]] * 4 + [urls[0]]

  went_on = ((r1, r2), (r2, r3), (r3, r4), (r2, r5), (r5, r6))
  assert [continues(a, b) for a, b in went_on] == [True] * 5
  assert len(turns) == 5 + seed + 1


@pytest.mark.parametrize("session_id", [None, "resp-failover"])
def test_a_chain_reaches_the_server_that_keeps_it_and_outlives_it(server, tokenizer,
                                                                  session_id):
  """Through a router, a call continuing a response goes to the server that keeps it
  (without a session header too: before, it went to any backend, which had not kept the
  response: 404); when that server is down, or restarted and has lost it, to a server
  with the chain's items as its input: the same conversation, and with a session header
  the tokens as sampled."""
  from rollout_server.server import create_app

  _, orch = server
  servers = [ServerThread(create_app(orch, tokenizer)).start() for _ in range(2)]
  try:
    with ServerThread(create_router([s.url for s in servers], health_interval_s=0.2)) \
        as router:
      c = client(router.url, session_id=session_id)
      ask = {"model": "tiny", "instructions": "Be brief.", "max_output_tokens": 6}
      raw = c.responses.with_raw_response.create(input="Say hi", **ask)
      home = raw.http_response.headers["x-routed-to"]
      links = [raw.parse()]
      # Streamed, then not: each continues the one before at its home.
      raw = c.responses.with_raw_response.create(
          previous_response_id=links[-1].id, input="Again?", stream=True, **ask)
      assert raw.http_response.headers["x-routed-to"] == home
      links += [e.response for e in raw.parse()
                if e.type in ("response.completed", "response.incomplete")]
      raw = c.responses.with_raw_response.create(
          previous_response_id=links[-1].id, input="Once more?", **ask)
      assert raw.http_response.headers["x-routed-to"] == home
      links.append(raw.parse())
      health = httpx.get(f"{router.url}/router/health").json()
      assert health["responses_kept"] == 3 and health["responses_made_whole"] == 0

      servers[[s.url for s in servers].index(home)].stop()  # its kept responses gone
      raw = c.responses.with_raw_response.create(
          previous_response_id=links[-1].id, input="And now?", **ask)
      other = raw.http_response.headers["x-routed-to"]
      assert other != home
      fourth = raw.http_response.json()
      # ... and the chain goes on there, at its new home, as sent.
      raw = c.responses.with_raw_response.create(
          previous_response_id=fourth["id"], input="Last?", **ask)
      assert raw.http_response.headers["x-routed-to"] == other
      links += [fourth, raw.parse()]
      # Its server restarted at its address (its kept responses and threads gone): the
      # router, told by its /health, sends the chain's items (and hands the session over).
      j = [s.url for s in servers].index(other)
      before = httpx.get(f"{other}/health").json()["instance"]
      servers[j].stop()
      servers[j] = ServerThread(create_app(orch, tokenizer), port=servers[j].port).start()
      assert httpx.get(f"{other}/health").json()["instance"] != before
      time.sleep(1.0)  # (health checks every 0.2 s)
      raw = c.responses.with_raw_response.create(
          previous_response_id=links[-1].id, input="After?", stream=True, **ask)
      assert raw.http_response.headers["x-routed-to"] == other
      (after,) = [e.response for e in raw.parse()  # (streamed: made whole all the same)
                  if e.type in ("response.completed", "response.incomplete")]
      assert after.previous_response_id == links[-1].id  # (as sent)
      health = httpx.get(f"{router.url}/router/health").json()
      turns = (httpx.get(f"{router.url}/sessions/{session_id}").json()["turns"]
               if session_id else None)
  finally:
    for s in servers:
      s.stop()
  assert health["responses_made_whole"] == 2 and health["responses_kept"] == 6
  assert fourth["previous_response_id"] == links[2].id  # (as sent, though made whole)
  whole = [{"role": "system", "content": "Be brief."}]
  for link, text in zip(links, ("Say hi", "Again?", "Once more?")):
    whole += [{"role": "user", "content": text},
              {"role": "assistant", "content": link.output_text}]
  whole.append({"role": "user", "content": "And now?"})
  if session_id is None:  # (each reply's text encoded again)
    assert fourth["jaxagent"]["prompt_ids"] == tokenizer.apply_chat_template(whole)
  else:  # handed over: each turn continues the one before as sampled
    assert len(turns) == 6
    for before, after in zip(turns, turns[1:]):
      context = before["prompt_ids"] + before["output_ids"]
      assert after["prompt_ids"][:len(context)] == context
    assert health["handovers"] == 2
    (seg,) = collect_session(turns, session_id=session_id, task_id="t")
    assert seg.decisions == [CLEAN] * 6


def test_a_chain_goes_on_where_it_is_kept_when_the_router_cannot_see_or_make_it_whole(
    server, tokenizer, monkeypatch):
  """Two reviewer's cases. (1) The session's server restarted and the router has not yet
  seen its new instance (between health checks): the chain's next call, answered 404
  there, went again made whole but without the session's threads: encoded from its text,
  a fork. The 404 is the news: the session is handed over. (2) A session's chain that
  the router can no longer make whole (its first response dropped from its record) went
  to the session's server, a certain 404, though the chain's own server kept it."""
  from rollout_server import router as router_lib, routing
  from rollout_server.server import create_app

  _, orch = server
  records = []

  def small(max_bytes=0):  # (the router's record, bounded to see it drop a response)
    records.append(RelayedResponses(6_000))
    return records[-1]

  monkeypatch.setattr(router_lib.responses_api, "RelayedResponses", small)
  servers = [ServerThread(create_app(orch, tokenizer)).start() for _ in range(2)]
  ask = {"model": "tiny", "max_output_tokens": 4}
  try:
    # (1) no health check after the first: the restart is seen only by its 404
    with ServerThread(create_router([s.url for s in servers], health_interval_s=3600)) \
        as router:
      c = client(router.url, session_id="resp-unseen")
      links = []
      for text in ("Say hi", "Again?"):
        raw = c.responses.with_raw_response.create(
            input=text, previous_response_id=links[-1].id if links else None, **ask)
        links.append(raw.parse())
      j = [s.url for s in servers].index(raw.http_response.headers["x-routed-to"])
      servers[j].stop()
      servers[j] = ServerThread(create_app(orch, tokenizer), port=servers[j].port).start()
      raw = c.responses.with_raw_response.create(input="After?",
                                                 previous_response_id=links[-1].id, **ask)
      assert raw.http_response.headers["x-routed-to"] == servers[j].url
      assert raw.parse().previous_response_id == links[-1].id
      health = httpx.get(f"{router.url}/router/health").json()
      assert health["handovers"] == 1 and health["responses_made_whole"] == 1
      turns = httpx.get(f"{router.url}/sessions/resp-unseen").json()["turns"]
      (seg,) = collect_session(turns, session_id="resp-unseen", task_id="t")
      assert seg.decisions == [CLEAN] * 3
    # (2)
    with ServerThread(create_router([s.url for s in servers], health_interval_s=0.2)) \
        as router:
      c = client(router.url, session_id="resp-away")
      raw = c.responses.with_raw_response.create(input="Say hi", **ask)
      own = raw.http_response.headers["x-routed-to"]
      first = raw.parse()
      j = [s.url for s in servers].index(own)
      servers[j].stop()
      raw = c.responses.with_raw_response.create(input="Again?", previous_response_id=first.id,
                                                 **ask)
      away, second = raw.http_response.headers["x-routed-to"], raw.parse()
      assert away != own
      servers[j] = ServerThread(create_app(orch, tokenizer), port=servers[j].port).start()
      time.sleep(1.0)  # (back in rotation: the session's turns go to it again)
      others = client(router.url)
      while first.id in records[-1]._kept:  # others' calls drop it (home() would use it)
        others.responses.create(input="z", **ask)
      raw = c.responses.with_raw_response.create(input="Next?",
                                                 previous_response_id=second.id, **ask)
      assert raw.http_response.headers["x-routed-to"] == away
      assert raw.parse().previous_response_id == second.id
    # (3) A chain that made whole would pass the servers' body bound: sent as it is to
    # the server that keeps it; where that is down, said (red team 41: 37 MB made-whole
    # bodies held by the router, a 413 in no API's shape)
    with ServerThread(create_router([s.url for s in servers], health_interval_s=600,
                                    max_body_bytes=500)) as router:
      raw = client(router.url).responses.with_raw_response.create(input="a" * 100, **ask)
      home, first = raw.http_response.headers["x-routed-to"], raw.parse()
      second = client(router.url).responses.create(input="b" * 100,
                                                   previous_response_id=first.id, **ask)
      ring = routing.HashRing([s.url for s in servers])
      elsewhere = next(f"s{i}" for i in range(100) if ring.candidates(f"s{i}")[0] != home)
      raw = client(router.url, session_id=elsewhere).responses.with_raw_response.create(
          input="c", previous_response_id=second.id, **ask)
      assert raw.http_response.headers["x-routed-to"] == home
      third = raw.parse()
      servers[[s.url for s in servers].index(home)].stop()  # (unseen: 600 s checks)
      with pytest.raises(openai.APIStatusError, match="made whole for a server that does "
                         "not keep it, is [0-9]+ bytes, over 500") as e:
        client(router.url, session_id=elsewhere).responses.create(
            input="d", previous_response_id=third.id, **ask)
      assert e.value.status_code == 413
      # A trailing slash is the same call (it was redirected to the backend itself).
      r = httpx.post(f"{router.url}/v1/responses/", json={"input": "d", **ask})
      assert r.status_code == 200 and r.headers["x-routed-to"] in [s.url for s in servers]
  finally:
    for s in servers:
      s.stop()
