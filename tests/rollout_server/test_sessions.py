"""Session records against real servers and on their own: the store's bounds, a call
that continues its session's thread with the tokens it was sampled as (past side calls,
summaries and another server's handover), and a reply sent back trained as sampled."""

import json

import httpx

from rollout_server.sessions import SESSION_HEADER
from tests.rollout_server.conftest import TOOLS, running_server


def client(srv):
  return httpx.Client(base_url=srv.url, timeout=120)


def test_sessions_are_bounded_by_count_bytes_and_time():
  from rollout_server.sessions import SessionStore

  now = [0.0]
  budget = 4000
  store = SessionStore(max_sessions=3, ttl_s=10.0, max_bytes=budget, clock=lambda: now[0])
  turn = lambda n: {"output_ids": list(range(n)), "recorded_at": 0.0}  # noqa: E731
  for i in range(4):
    store.record(f"s{i}", turn(10))
  assert len(store) == 3 and store.get("s0") is None and store.evicted["count"] == 1
  small = store.bytes // 3  # ten ids packed (40 bytes) and the rest of the record
  # budget - 2 * small < its size <= budget - small: s1 goes by count, then s2 by bytes
  store.record("big", turn((budget - small - (small - 40)) // 4))
  assert [store.get(k) is None for k in ("s1", "s2", "s3", "big")] == [True, True, False, False]
  assert store.evicted == {"count": 2, "bytes": 1, "ttl": 0} and small < store.bytes <= budget
  store.record("huge", turn(budget // 4))  # over the budget alone: nothing is kept
  assert len(store) == 0 and store.bytes == 0 and store.evicted["bytes"] == 4
  store = SessionStore(max_sessions=10, ttl_s=10.0, max_bytes=None, clock=lambda: now[0])
  store.record("a", turn(5))
  now[0] = 5.0
  store.record("b", turn(5))
  now[0] = 12.0  # a's last turn was 12 s ago, b's 7 s ago
  assert store.get("a") is None and store.get("b") is not None and store.evicted["ttl"] == 1
  store.record("b", turn(5))  # a new turn renews b
  now[0] = 20.0
  assert store.get("b") is not None and len(store.get("b")) == 2
  size = store.bytes
  assert store.pop("b") is not None and store.bytes == 0 and size > 0
  store.record("c", turn(5))  # at 20 s
  now[0] = 30.0  # its last turn exactly its TTL ago: kept; past it, gone
  assert store.get("c") is not None and store.evicted["ttl"] == 1
  now[0] = 30.001
  assert store.get("c") is None and store.evicted["ttl"] == 2 and store.bytes == 0


def test_a_session_dropped_while_it_plays_says_so_on_its_next_records_first_turn():
  """A session a bound dropped and its agent then called again holds its later turns
  only: the first turn it records itself says what was lost (a reviewer: trained as the
  whole episode, its per-turn rewards fell on the wrong turns). Not a router's copy made
  whole again, a deleted session, one carried from another server, nor a later turn."""
  from rollout_server.sessions import SessionStore

  now = [0.0]
  store = SessionStore(max_sessions=2, ttl_s=10.0, clock=lambda: now[0])
  turn = lambda: {"output_ids": [1, 2], "recorded_at": 0.0}  # noqa: E731
  store.record("a", turn())
  store.record("a", turn())
  store.record("b", turn())
  store.record("c", turn())  # a goes by count
  store.record("a", turn())
  store.record("a", turn())
  got = store.get("a")
  assert got[0]["lost_before"] == {"reason": "count", "turns": 2}
  assert "lost_before" not in got[1]
  now[0] = 20.0  # every session past its time to live
  store.record("a", turn())
  assert store.get("a")[0]["lost_before"] == {"reason": "ttl", "turns": 2}
  assert store.get("c") is None  # (dropped by its time to live too)
  store.pop("c")  # deleted after it was dropped (cleared for a new episode)
  store.record("c", turn())
  assert "lost_before" not in store.get("c")[0]
  router = SessionStore(max_sessions=1)  # a router's copy, dropped and copied whole again
  router.extend("r", [turn()], number=True)
  router.extend("s", [turn()], number=True)
  router.extend("r", [turn(), turn()], number=True)
  assert all("lost_before" not in t for t in router.get("r"))
  store.record("d", turn())  # a session carried from another server after it was dropped
  store.record("e", turn())
  store.record("f", turn())
  store.carry("d", [{"prompt_ids": [1], "messages": [{"role": "user", "content": "x"}],
                     "replies": [{"output_ids": [2], "response": None}]}])
  store.record("d", turn())
  assert "lost_before" not in store.get("d")[0]


def test_a_recorded_turn_revived_is_continued_with_its_own_tokens():
  """A call that says which turn it goes on from (a Responses call's previous_response_id)
  makes that turn a thread again, so the call continues its tokens as sampled (here not
  its text's encoding), though later turns went on from it another way."""
  from rollout_server.sessions import SessionStore

  store = SessionStore(10)

  def turn(texts, prompt, out):
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t}
                for i, t in enumerate(texts)]
    return {"prompt_ids": prompt, "output_ids": out, "messages": messages, "tools": None,
            "response": {"role": "assistant", "content": "x"}}

  where = store.record("s", turn(["one"], [1, 2], [7, 7, 7]))
  store.record("s", turn(["one", "A", "two"], [1, 2, 7, 7, 7, 3], [8]))
  store.record("s", turn(["one", "A", "two", "B", "three"], [1, 2, 7, 7, 7, 3, 8, 4], [9]))
  later = turn(["one", "A", "two again"], [], [])["messages"]
  assert store.last_turn("s", later, None) is None  # (turn 0 is no thread now)
  assert not store.revive("s", "another-record", where[1])  # (a session made anew)
  assert not store.revive("s", where[0], 5) and not store.revive("t", *where)
  assert store.revive("s", *where) and not store.revive("s", *where)
  got = store.last_turn("s", later, None)
  assert got.prompt_ids == [1, 2] and got.replies[0][0] == [7, 7, 7]
  assert store.bytes == store._sessions["s"].size
  # A retry's sibling (the same prompt, another reply) is already among its thread's
  # replies: not made a thread of its own (which would drop the replies it is among).
  first = store.record("r", turn(["one"], [1, 2], [5]))
  store.record("r", turn(["one"], [1, 2], [6]))
  assert not store.revive("r", *first)
  assert [r[0] for r in store.last_turn("r", later, None).replies] == [[6], [5]]
  # The session revived is the most recently used: its own growth does not evict it.
  store = SessionStore(10, max_bytes=None)
  where = store.record("s", turn(["one"], [1, 2], [7, 7, 7]))
  store.record("s", turn(["one", "A", "two"], [1, 2, 7, 7, 7, 3], [8]))
  store.record("s", turn(["one", "A", "two", "B", "three"], [1, 2, 7, 7, 7, 3, 8, 4], [9]))
  store.record("other", turn(["hi"], [5], [6]))
  store.max_bytes = store.bytes + 1
  assert store.revive("s", *where) and store.get("s") is not None
  assert store.get("other") is None and store.evicted["bytes"] == 1


def test_a_sessions_record_grows_with_its_context_not_its_turns_times_it():
  """Each turn sends the whole conversation again; the store keeps what a turn shares
  with the one before once, and gives every turn back exactly as it was recorded."""
  import copy

  import numpy as np
  from rollout_server.sessions import SessionStore, held_bytes

  def play(turns: int, store: SessionStore, session: str, side_calls: bool = False
           ) -> list[dict]:
    rng = np.random.default_rng(0)
    prompt, messages, recorded = [1, 2, 3], [{"role": "user", "content": "go"}], []
    for t in range(turns):
      out = [int(i) for i in rng.integers(0, 50_000, 40)]
      turn = {"prompt_ids": prompt, "output_ids": out, "versions": [t] * len(out),
              "output_logprobs": [float(x) for x in -rng.random(len(out))],
              "raw_logprobs": [-0.5] * len(out), "messages": messages,
              "tools": [{"type": "function", "function": {"name": "run"}}],
              "finish_reason": "stop", "ttft_s": None, "recorded_at": 1.0 * t}
      if t == 5:  # a rewritten context (a summary) shares nothing with the turn before
        turn.update(prompt_ids=[7] * 90, messages=[{"role": "system", "content": "sum"}])
      if t == 6:  # values an array cannot hold as they are stay as they are
        turn.update(versions=[True] * len(out), output_ids=out[:-1] + [1 << 70])
      if t == 8:  # a message equal to the one before as a value, not as JSON
        turn["messages"] = [{**messages[0], "n": 1.0}, *messages[1:]]
      if t == 9:
        turn["messages"] = [{**messages[0], "n": 1}, *messages[1:]]
      recorded.append(copy.deepcopy(turn))
      if store is not None:
        store.record(session, turn)
      if side_calls and t not in (5, 6):  # a title of the conversation so far, each turn
        side = dict(recorded[-1], prompt_ids=[9] + turn["prompt_ids"] + out,
                    messages=[{"role": "system", "content": "Title?"}, *turn["messages"]],
                    output_ids=[5, 5], output_logprobs=[-1.0, -1.0], versions=[t, t],
                    raw_logprobs=[-1.0, -1.0])
        recorded.append(copy.deepcopy(side))
        if store is not None:
          store.record(session, side)
      prompt = turn["prompt_ids"] + out + [int(i) for i in rng.integers(0, 50_000, 300)]
      messages = turn["messages"] + [{"role": "assistant", "content": "x" * 100},
                                     {"role": "tool", "content": "y" * 1200}]
    return recorded

  store = SessionStore(max_sessions=10)
  recorded = play(24, store, "a")
  got = store.get("a")
  assert store.read("a", since=20)[:2] == (got[20:], 24) and store.read("b") is None
  assert [t.pop("turn") for t in got] == list(range(24))
  assert json.dumps(got) == json.dumps(recorded)  # types too: no int became a float
  assert got == recorded and store.pop("a") == [dict(t, turn=i) for i, t in enumerate(got)]
  # The record is its own: neither a caller changing what it recorded nor a reader
  # changing what it read changes it
  store = SessionStore(max_sessions=10)
  first = {"messages": [{"role": "user", "content": "go"}], "recorded_at": 0.0}
  store.record("c", first)
  store.record("c", {"messages": [{"role": "user", "content": "go"}, {"role": "tool"}],
                     "recorded_at": 0.0})
  want = json.dumps(store.get("c"))
  first["messages"][0]["content"] = "changed"
  store.get("c")[0]["messages"].insert(0, {"role": "system"})
  assert json.dumps(store.get("c")) == want
  # What it counts is what it holds (its Python objects, the context it keeps for the
  # next turn included; many short messages too)
  import tracemalloc
  for kind in ("long", "short", "containers"):
    store, recorded = SessionStore(max_sessions=10), play(48, None, "m")
    if kind == "short":
      for n, t in enumerate(recorded):
        t["messages"] = [{"role": "tool", "content": str(i)} for i in range(20 * n)]
    if kind == "containers":  # (a field of empty lists: 3 characters of JSON, 64 bytes,
      # each; counted by its JSON, a store held 18 times its bound; a reviewer)
      for n, t in enumerate(recorded):
        t["messages"] = t["messages"][:1] + [
            {"role": "user", "content": "hi", "x": [[] for _ in range(500)]}] * n
    tracemalloc.start()
    for t in recorded:
      store.record("m", t)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert held < 1.6 * store.bytes, (kind, held, store.bytes)
  sizes = {}
  for turns in (12, 24, 48):
    store = SessionStore(max_sessions=10)
    recorded = play(turns, store, "s")
    sizes[turns] = store.bytes
    whole = sum(map(held_bytes, recorded))  # what storing each turn whole took
    assert store.bytes < whole / (turns / 8), (turns, store.bytes, whole)
  # linear in the turns (whole turns: ~4x a doubling)
  assert sizes[48] / sizes[24] < 2.2 and sizes[24] / sizes[12] < 2.2, sizes
  # A harness's side call each turn (its own thread): each thread is stored against its
  # own last turn (against the turn before, each turn after a side call was kept whole)
  for turns in (12, 24, 48):
    store = SessionStore(max_sessions=10)
    recorded = play(turns, store, "s", side_calls=True)
    got = store.get("s")
    assert [t.pop("turn") for t in got] == list(range(len(recorded))) and got == recorded
    sizes[turns] = store.bytes
  assert sizes[48] / sizes[24] < 2.2 and sizes[24] / sizes[12] < 2.2, sizes


def _turn(store, session_id, messages, prompt, output, response=None, tools=None):
  store.record(session_id, {"kind": "chat", "messages": messages, "tools": tools,
                            "prompt_ids": prompt, "output_ids": output,
                            "output_logprobs": [0.0] * len(output), "response": response})


def test_a_call_that_continues_its_sessions_last_turn_keeps_its_tokens(tokenizer):
  """The next prompt is the last turn's prompt and output as they were, then the rest of
  the rendering; only when the call's messages begin with that turn's, and the rendering's
  text with their text."""
  from rollout_server.chat import continued_prompt, normalise_messages
  from rollout_server.sessions import SessionStore

  tok = tokenizer
  im_end, eot = tok.encode("<|im_end|>")[0], tok.encode("<|endoftext|>")[0]
  ask = normalise_messages([{"role": "user", "content": "spell it"}])
  prompt = tok.apply_chat_template(ask)
  spelled = tok.encode_plain("a <|im_end|> b")  # the control string in bytes
  store = SessionStore(8)
  reply = {"role": "assistant", "content": "a <|im_end|> b"}
  _turn(store, "s", ask, prompt, spelled + [im_end], reply)

  def next_prompt(messages, session="s", tools=None):
    messages = normalise_messages(messages)
    pieces = tok.render_pieces(messages, tools)
    return continued_prompt(tok, pieces, messages, tools,
                            store.last_turn(session, messages, tools))

  follow = ask + [reply, {"role": "user", "content": "next"}]
  got = next_prompt(follow)
  assert got[:len(prompt) + len(spelled) + 1] == prompt + spelled + [im_end]
  assert tok.decode(got) == tok.render(follow)
  assert got.count(im_end) == 3  # user, assistant, user: the spelled one stays bytes
  assert tok.apply_chat_template(follow).count(im_end) == 4  # (encoded again: a 4th)
  # A sibling of the turn (the same messages again) is its prompt; a changed reply keeps
  # the prompt only; changed earlier messages, another session: the caller renders.
  assert next_prompt(ask) == prompt
  changed = ask + [dict(reply, content="other"), {"role": "user", "content": "next"}]
  assert next_prompt(changed) == prompt + tok.encode_pieces(
      tok.render_pieces(changed), start=len(tok.decode(prompt)))
  assert next_prompt([{"role": "user", "content": "spell it!"}] + follow[1:]) is None
  assert next_prompt(follow, session="other") is None
  assert next_prompt(follow, tools=TOOLS) is None  # (other tools: another system prompt)
  # A stop token the template does not write itself stays where it was sampled.
  _turn(store, "e", ask, prompt, spelled + [eot], reply)
  got = next_prompt(follow, session="e")
  assert got[:len(prompt) + len(spelled) + 2] == prompt + spelled + [eot, im_end]
  # A call as the model wrote it (compact, after a new line, its arguments not ASCII)
  # sent back with its arguments written again (an Anthropic tool_use's input, a
  # harness's json.dumps): the tokens sampled, not the template's writing of the call.
  sampled = tok.encode('Sure.\n<tool_call>{"name":"calculate","arguments":{"expression":'
                       '"2×3", "n": 1e5}}</tool_call><|im_end|>')
  called = {"role": "assistant", "content": "Sure.", "tool_calls": [
      {"id": "c_0", "type": "function", "function": {
          "name": "calculate", "arguments": '{"expression":"2×3", "n": 1e5}'}}]}
  _turn(store, "t", ask, prompt, sampled, called)
  again = dict(called, tool_calls=[{"id": "c_0", "type": "function", "function": {
      "name": "calculate", "arguments": json.dumps({"expression": "2×3", "n": 1e5})}}])
  follow = ask + [again, {"role": "tool", "tool_call_id": "c_0", "content": "6"}]
  got = next_prompt(follow, session="t")
  assert got[:len(prompt) + len(sampled)] == prompt + sampled
  assert tok.decode(got[len(prompt) + len(sampled):]) == (
      "\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n")
  # A sibling sampled from the same prompt after it (a retry, a best-of-n), the agent
  # keeping the first reply: that reply's tokens (a reviewer: only the last one's were).
  _turn(store, "t", ask, prompt, tok.encode("Other.<|im_end|>"),
        {"role": "assistant", "content": "Other."})
  got = next_prompt(follow, session="t")
  assert got[:len(prompt) + len(sampled)] == prompt + sampled
  changed = dict(again, content="Sure!")  # (a reply the agent changed: the prompt only)
  assert next_prompt(ask + [changed] + follow[2:], session="t")[:len(prompt) + 1] == \
      prompt + tok.encode("Sure!")[:1]
  # The call handed back in the reply's text, no tool_calls (the built-in OpenAI agent,
  # a harness sending `reply_text(message)`): the tokens sampled too (a reviewer: encoded
  # again from the text, it forked); other values in it, or text around it, are another
  # reply.
  from jaxagent.blackbox import reply_text

  texted = {"role": "assistant", "content": reply_text(called)}
  assert "<tool_call>" in texted["content"] and "tool_calls" not in texted
  then = [{"role": "user", "content": "6"}]
  got = next_prompt(ask + [texted] + then, session="t")
  assert got[:len(prompt) + len(sampled)] == prompt + sampled
  # (a reply whose text began with white space: recorded with it, as sent back)
  spaced = dict(called, content="\nSure.")
  _turn(store, "w", ask, prompt, tok.encode("\n") + sampled, spaced)
  got = next_prompt(ask + [{"role": "assistant", "content": reply_text(spaced)}] + then,
                    session="w")
  assert got[:len(prompt) + len(sampled) + 1] == prompt + tok.encode("\n") + sampled
  for other in (texted["content"].replace("2×3", "2×4"), texted["content"] + " ok",
                texted["content"].replace("</tool_call>", "")):
    got = next_prompt(ask + [dict(texted, content=other)] + then, session="t")
    assert got[:len(prompt) + len(sampled)] != prompt + sampled, other
  # A best-of-two whose replies call with the same values written otherwise, the agent
  # keeping the first (its call id and its text): the first's tokens, not the newer
  # sibling's read the same by value (a reviewer).
  def call(text, call_id):
    return {"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type":
            "function", "function": {"name": "calculate", "arguments": text}}]}

  spaced, tight = '{"expression": "1"}', '{"expression":"1"}'
  kept = tok.encode(f'<tool_call>{{"name": "calculate", "arguments": {spaced}}}</tool_call>'
                    "<|im_end|>")
  other = tok.encode(f'<tool_call>{{"name":"calculate","arguments":{tight}}}</tool_call>'
                     "<|im_end|>")
  _turn(store, "b", ask, prompt, kept, call(spaced, "c_a"))
  _turn(store, "b", ask, prompt, other, call(tight, "c_b"))
  sent = ask + [call(spaced, "c_a"), {"role": "tool", "tool_call_id": "c_a", "content": "1"}]
  assert next_prompt(sent, session="b")[:len(prompt) + len(kept)] == prompt + kept
  sent[1:] = [call(tight, "c_b"), dict(sent[2], tool_call_id="c_b")]
  assert next_prompt(sent, session="b")[:len(prompt) + len(other)] == prompt + other


def test_a_call_continues_its_thread_past_side_calls_and_on_another_server(tokenizer):
  """A session's call continues the turn of its own thread, not only the session's last
  turn: a harness's side call (a title, a summary: other messages) between two turns
  made the next turn encoded again from its text (a fork). `SessionStore.handover` on
  one store and `carry` on another (a router failing the session over) give the other
  store the threads; its own record is unchanged, its bytes count what it holds."""
  from rollout_server.sessions import MAX_HEADS, SessionStore

  tok = tokenizer
  ask = [{"role": "user", "content": "go"}]
  prompt = tok.apply_chat_template(ask)
  call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c_1", "type": "function",
          "function": {"name": "calculate", "arguments": '{"expression":"1+1"}'}}]}
  title = [{"role": "system", "content": "Write a title."}, {"role": "user", "content": "go"}]
  ran, other = SessionStore(8), SessionStore(8)
  _turn(ran, "s", ask, prompt, [7, 8, 9], call)
  _turn(ran, "s", title, [4, 4], [5], {"role": "assistant", "content": "A title"})
  follow = ask + [call, {"role": "tool", "tool_call_id": "c_1", "content": "2"}]
  last = ran.last_turn("s", follow, None)  # (the side call was the last turn)
  assert last.prompt_ids == prompt and last.replies == [([7, 8, 9], call)]
  assert ran.last_turn("s", title, None).prompt_ids == [4, 4]
  # A sibling (the same prompt again) is kept beside the reply before it.
  _turn(ran, "s", ask, prompt, [6, 6], {"role": "assistant", "content": "retry"})
  assert ran.last_turn("s", follow, None).replies == [
      ([6, 6], {"role": "assistant", "content": "retry"}), ([7, 8, 9], call)]

  _turn(other, "s", [{"role": "user", "content": "older"}], [1, 2], [3])  # its own turn
  handed = ran.handover("s")
  assert handed == [
      {"prompt_ids": [4, 4], "messages": title, "tools": None,
       "replies": [{"output_ids": [5], "response": {"role": "assistant", "content": "A title"}}]},
      {"prompt_ids": prompt, "messages": ask, "tools": None, "replies": [
          {"output_ids": [6, 6], "response": {"role": "assistant", "content": "retry"}},
          {"output_ids": [7, 8, 9], "response": call}]}]
  before = other.bytes
  other.carry("s", handed)
  assert other.bytes > before and len(other.get("s")) == 1
  assert other.sampled_calls("s") == {"c_1": '{"expression":"1+1"}'}
  assert other.last_turn("s", follow, None) == ran.last_turn("s", follow, None)
  assert other.last_turn("s", title, None).prompt_ids == [4, 4]
  assert other.last_turn("s", [{"role": "user", "content": "older"}], None).prompt_ids == [1, 2]
  assert other.last_turn("s", ask, TOOLS) is None  # (other tools)
  _turn(other, "s", follow, prompt + [7, 8, 9, 5], [6])  # a turn here goes on from it
  assert other.last_turn("s", follow, None).prompt_ids == prompt + [7, 8, 9, 5]
  assert other.bytes == sum(s.size for s in other._sessions.values())
  for i in range(MAX_HEADS):  # (threads past the bound: the oldest go)
    _turn(other, "s", [{"role": "user", "content": f"side {i}"}], [9, i], [3])
  assert other.last_turn("s", follow, None) is None
  assert other.last_turn("s", [{"role": "user", "content": "side 0"}], None) is not None
  assert other.bytes == sum(s.size for s in other._sessions.values())
  other.carry("new", [{"prompt_ids": [1], "messages": ask, "tools": None,
                       "replies": [{"output_ids": [2], "response": None}]}])  # a new session
  assert other.get("new") == [] and other.last_turn("new", ask, None).prompt_ids == [1]
  assert other.pop("new") == [] and other.bytes == other._sessions["s"].size
  assert ran.handover("none") is None


def test_a_summary_or_a_side_call_keeps_the_agents_thread_and_a_handover_its_own_turns():
  """Reviewers' cases. A summary call (the whole conversation, and a request for a
  summary) goes on from the agent's last turn; the agent's next call, with fewer
  messages, still continues that turn, here and on a server the session is handed to.
  A side call whose prompt is the first turn's does not end the agent's thread. A
  handover does not hide a turn this store ran itself: a newer sibling's reply, a
  thread it went on with (the router's copy may be behind)."""
  from rollout_server.sessions import SessionStore

  u = [{"role": "user", "content": "go"}]
  hi = {"role": "assistant", "content": "hi"}
  obs = {"role": "user", "content": "obs"}
  summary = {"role": "user", "content": "Summarize."}
  store = SessionStore(8)
  _turn(store, "m", u, [1, 2], [10, 11], hi, tools=TOOLS)
  _turn(store, "m", u + [hi, obs, summary], [1, 2, 10, 11, 5, 8], [40],
        {"role": "assistant", "content": "sum"})  # (without the tools)
  last = store.last_turn("m", u + [hi, obs], TOOLS)
  assert last.prompt_ids == [1, 2] and last.replies == [([10, 11], hi)]
  assert store.last_turn("m", u + [hi, obs], None) is None
  other = SessionStore(8)
  other.carry("m", store.handover("m"))
  assert other.last_turn("m", u + [hi, obs], TOOLS) == last
  assert other.last_turn("m", u + [hi, obs, summary], None).prompt_ids == [1, 2, 10, 11, 5, 8]

  side = [{"role": "system", "content": "Title?"}] + u
  store = SessionStore(8)
  _turn(store, "s", u, [1, 2], [10, 11], hi)
  _turn(store, "s", u + [hi, obs], [1, 2, 10, 11, 5, 6], [20], {"role": "assistant",
                                                             "content": "x"})
  _turn(store, "s", side, [1, 2], [30], {"role": "assistant", "content": "A title"})
  last = store.last_turn("s", u + [hi, obs, {"role": "assistant", "content": "x"}], None)
  assert last.prompt_ids == [1, 2, 10, 11, 5, 6]

  r1, r2 = {"role": "assistant", "content": "r1"}, {"role": "assistant", "content": "r2"}
  copy, own = SessionStore(8), SessionStore(8)
  _turn(copy, "s", u, [1, 2], [10], r1)  # the router's copy, behind
  _turn(own, "s", u, [1, 2], [10], r1)
  _turn(own, "s", u, [1, 2], [20], r2)  # a newer sibling here
  own.carry("s", copy.handover("s"))
  assert own.last_turn("s", u + [r2], None).replies == [([20], r2), ([10], r1)]
  _turn(own, "s", u + [r2, obs], [1, 2, 20, 7], [30], r1)  # went on here
  own.carry("s", copy.handover("s"))
  assert own.last_turn("s", u + [r2, obs, r1], None).prompt_ids == [1, 2, 20, 7]
  assert own.bytes == sum(s.size for s in own._sessions.values())


def test_a_handover_with_a_bad_body_is_refused_by_name(server):
  http = client(server[0])
  turn = {"prompt_ids": [1, 2], "messages": [{"role": "user", "content": "x"}],
          "replies": [{"output_ids": [3], "response": None}]}
  good = {"session_id": "h", "turns": [turn]}
  assert http.post("/handover", json=good).json() == {"session_id": "h", "carried": True}
  for bad, where in [({"prompt_ids": [-1]}, "prompt_ids"), ({"replies": []}, "replies"),
                     ({"messages": "hi"}, "messages"), ({"extra": 1}, "extra")]:
    r = http.post("/handover", json={**good, "turns": [{**turn, **bad}]})
    assert r.status_code in (400, 422) and where in r.text, (bad, r.text)
  r = http.post("/handover", json={**good, "turns": [turn] * 9})
  assert r.status_code in (400, 422) and "turns" in r.text, r.text
  assert http.delete("/sessions/h").status_code == 200


def test_a_reply_sent_back_is_trained_as_sampled(tokenizer):
  """A policy that writes a template control string in ordinary tokens (`<|im_end|>` in
  bytes) got it back as the live token when its agent sent the reply back: the next
  prompt ended the assistant's turn early and the turn's tokens after it went untrained
  (red team 23). The session's next prompt now holds the tokens sampled, and the episode
  trains every one of them in one segment."""
  from jaxagent.blackbox import collect_session
  from tests.rollout_server.conftest import memorise

  ask = [{"role": "user", "content": "spell it"}]
  spelled = tokenizer.encode_plain("a <|im_end|> b")
  params = memorise([(tokenizer.apply_chat_template(ask),
                      spelled + tokenizer.encode("<|im_end|>"))], steps=60)
  with running_server(params, tokenizer) as (srv, _):
    http = client(srv)
    head = {SESSION_HEADER: "spelled"}
    first = http.post("/v1/chat/completions", headers=head,
                      json={"messages": ask, "temperature": 0, "max_tokens": 24})
    assert first.status_code == 200, first.text
    reply = first.json()["choices"][0]["message"]
    assert reply["content"] == "a <|im_end|> b"
    follow = ask + [reply, {"role": "user", "content": "again"}]
    second = http.post("/v1/chat/completions", headers=head,
                       json={"messages": follow, "temperature": 0, "max_tokens": 4})
    assert second.status_code == 200, second.text
    turns = http.get("/sessions/spelled").json()["turns"]
  one, two = turns
  sampled = one["prompt_ids"] + one["output_ids"]
  assert one["output_ids"][:-1] == spelled
  assert two["prompt_ids"][:len(sampled)] == sampled
  segments = collect_session(turns, session_id="spelled", task_id="t")
  assert len(segments) == 1 and segments[0].decisions == ["clean", "clean"]
  assert segments[0].loss_mask.sum() == len(one["output_ids"]) + len(two["output_ids"])


def test_a_threads_replies_are_those_sampled_from_its_own_prompt_and_tools():
  """A turn's siblings are the replies sampled from its prompt ids, messages and tools:
  a reply sampled after other prompt ids (the same messages encoded otherwise) or with
  other tools is not one the next call may continue with its tokens (they were sampled
  in another context). Replies are bounded; one dropped past the bound is revived."""
  from rollout_server.sessions import MAX_REPLIES, SessionStore

  u = [{"role": "user", "content": "go"}]
  r = [{"role": "assistant", "content": f"r{i}"} for i in range(MAX_REPLIES + 2)]
  store = SessionStore(8)
  _turn(store, "p", u, [1, 2], [7], r[0])
  _turn(store, "p", u, [1, 3], [8], r[1])  # (the same messages, other prompt ids)
  assert store.last_turn("p", u + [r[0]], None).replies == [([8], r[1])]
  _turn(store, "t", u, [1, 2], [7], r[0], tools=TOOLS)
  _turn(store, "t", u, [1, 2], [8], r[1])  # (other tools: a template may not show them)
  assert store.last_turn("t", u + [r[0]], None).replies == [([8], r[1])]
  # MAX_REPLIES + 1 siblings: the newest MAX_REPLIES are kept; the first, dropped, is a
  # recorded turn a call may still say it goes on from (revive).
  first = store.record("b", {"kind": "chat", "messages": u, "tools": None,
                             "prompt_ids": [1], "output_ids": [100], "response": r[0]})
  for i in range(1, MAX_REPLIES + 1):
    _turn(store, "b", u, [1], [100 + i], r[i])
  replies = store.last_turn("b", u + [r[0]], None).replies
  assert [out for out, _ in replies] == [[100 + i] for i in range(MAX_REPLIES, 0, -1)]
  assert store.revive("b", *first)
  assert store.last_turn("b", u + [r[0]], None).replies == [([100], r[0])]
  assert store.bytes == sum(s.size for s in store._sessions.values())


def test_a_turn_goes_on_from_a_thread_only_when_its_tokens_continue_the_threads():
  """A summary call (more messages) whose prompt ids do not begin with the agent's last
  turn's tokens (encoded again from the text: a fork) is no continuation of that turn:
  the agent's next call is not given that turn's prompt as the new turn's ids sliced
  (ids never sampled from). A turn that is a thread's parent is not revived as a second
  thread."""
  from rollout_server.sessions import SessionStore

  u = [{"role": "user", "content": "go"}]
  hi, obs = {"role": "assistant", "content": "hi"}, {"role": "user", "content": "obs"}
  summary = {"role": "user", "content": "Summarize."}
  store = SessionStore(8)
  _turn(store, "f", u, [1, 2], [10, 11], hi)
  _turn(store, "f", u + [hi, obs, summary], [1, 3, 10, 11, 5, 8], [40],
        {"role": "assistant", "content": "sum"})  # (its ids fork at the second)
  assert store.last_turn("f", u + [hi, obs], None) is None
  store = SessionStore(8)
  where = store.record("m", {"kind": "chat", "messages": u, "tools": None,
                             "prompt_ids": [1, 2], "output_ids": [10, 11], "response": hi})
  _turn(store, "m", u + [hi, obs, summary], [1, 2, 10, 11, 5, 8], [40],
        {"role": "assistant", "content": "sum"})
  assert store.last_turn("m", u + [hi, obs], None).prompt_ids == [1, 2]
  size = store.bytes
  assert not store.revive("m", *where) and store.bytes == size
  assert len(store._sessions["m"].heads) == 1


def test_a_carried_siblings_replies_stay_bounded_and_carried_messages_are_counted():
  """Replies a handover merges into this store's own sibling are bounded as its own are;
  the messages of a carried thread are counted as what they hold (many short messages:
  their objects, not their JSON's few bytes)."""
  import gc
  import tracemalloc

  from rollout_server.sessions import MAX_REPLIES, SessionStore

  u = [{"role": "user", "content": "go"}]
  own = SessionStore(8)
  for i in range(MAX_REPLIES):
    _turn(own, "s", u, [1], [100 + i], {"role": "assistant", "content": f"r{i}"})
  own.carry("s", [{"prompt_ids": [1], "messages": u, "tools": None, "replies": [
      {"output_ids": [200 + i], "response": None} for i in range(3)]}])
  replies = own.last_turn("s", u + [{"role": "assistant", "content": "r0"}], None).replies
  assert len(replies) == MAX_REPLIES
  assert [out for out, _ in replies] == [[100 + i] for i in range(MAX_REPLIES - 1, -1, -1)]

  store = SessionStore(8)
  was = tracemalloc.is_tracing()
  tracemalloc.start()
  try:  # (what this code holds: from here, and tracing stopped whatever it raises)
    base = tracemalloc.get_traced_memory()[0]
    handed = [{"prompt_ids": list(range(100)), "messages": [
        {"role": "tool", "content": str(i)} for i in range(4000)], "tools": None,
        "replies": [{"output_ids": [1], "response": None}]}]
    store.carry("s", handed)
    del handed
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
  finally:
    if not was:
      tracemalloc.stop()
  assert held < 1.6 * store.bytes, (held, store.bytes)


def test_a_summarys_parents_replies_are_counted_where_they_were_carried():
  """A thread carried with the turn it went on from (a summary's, after the agent's
  turn) holds that turn's replies (a retry's siblings, sampled long): counted, so the
  byte bound holds."""
  import gc
  import tracemalloc

  from rollout_server.sessions import SessionStore

  u = [{"role": "user", "content": "go"}]
  long_a, long_b = list(range(1, 50_001)), list(range(2, 50_002))
  a, b = {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}
  summary = [{"role": "user", "content": "obs"}, {"role": "user", "content": "Summarize."}]
  ran = SessionStore(8)
  _turn(ran, "s", u, [1, 2], long_b, b)
  _turn(ran, "s", u, [1, 2], long_a, a)  # (a retry: its sibling)
  _turn(ran, "s", u + [a] + summary, [1, 2] + long_a + [5], [40],
        {"role": "assistant", "content": "sum"})
  handed = ran.handover("s")
  assert [len(t["replies"]) for t in handed] == [2, 1]
  other = SessionStore(8)
  gc.collect()
  was = tracemalloc.is_tracing()
  tracemalloc.start()
  try:  # (what the carry holds: from here, and tracing stopped whatever it raises)
    base = tracemalloc.get_traced_memory()[0]
    other.carry("s", handed)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
  finally:
    if not was:
      tracemalloc.stop()
  got = other.last_turn("s", u + [b, summary[0]], None)
  assert got.prompt_ids == [1, 2] and [out for out, _ in got.replies] == [long_a, long_b]
  assert held < 1.6 * other.bytes, (held, other.bytes)


def test_a_calls_arguments_are_restored_as_sampled_only_for_its_own_id_and_values():
  """`with_sampled_arguments`: a call sent back with its arguments' values written
  otherwise (spacing, key order) carries the text sampled for its own id; a call whose
  values the agent changed, an id the session never sampled, another role's message keep
  what was sent. `_same_reply`: a reply is the one sampled only with its calls' names and
  readable argument values (its ids aside)."""
  from rollout_server.chat import _same_reply, with_sampled_arguments

  def call(cid, arguments, name="run"):
    return {"id": cid, "type": "function",
            "function": {"name": name, "arguments": arguments}}

  calls = {"c_0": '{"a":1}', "c_1": '{"a": 1,"b":2}'}
  sent = [{"role": "user", "content": "go", "tool_calls": [call("c_0", '{"a": 1}')]},
          {"role": "assistant", "content": "", "tool_calls": [
              call("c_0", '{"a": 1}'), call("c_1", json.dumps({"b": 2, "a": 1})),
              call("c_2", '{"a": 1}'), call("c_1", '{"a": 2, "b": 2}'), "odd"]}]
  got = with_sampled_arguments(sent, calls)
  assert got[0] == sent[0]
  assert [c["function"]["arguments"] if isinstance(c, dict) else c
          for c in got[1]["tool_calls"]] == [
      '{"a":1}', '{"a": 1,"b":2}', '{"a": 1}', '{"a": 2, "b": 2}', "odd"]
  assert sent[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # (a copy)
  assert with_sampled_arguments(sent, {}) is sent
  # Arguments sent back as an object, or none ("", null), as the gateway reads them in:
  # the sampled text (an object was read as another reply, the turn forked; a reviewer).
  from rollout_server.chat import normalise_messages

  back = normalise_messages([{"role": "assistant", "content": None, "tool_calls": [
      call("c_0", {"a": 1}), call("c_1", None), call("c_2", "")]}])
  got = with_sampled_arguments(back, {"c_0": '{"a":1}', "c_1": "{}", "c_2": "{ }"})
  assert [c["function"]["arguments"] for c in got[0]["tool_calls"]] == ['{"a":1}', "{}", "{ }"]

  recorded = {"role": "assistant", "content": "ok", "tool_calls": [call("c_0", '{"a":1}')]}
  assert _same_reply(dict(recorded, tool_calls=[call("x", '{ "a" : 1 }')]), recorded)
  assert not _same_reply(dict(recorded, tool_calls=[call("c_0", '{"a":1}', "other")]),
                         recorded)
  assert not _same_reply(dict(recorded, content="ok!"), recorded)
  assert not _same_reply(dict(recorded, tool_calls=[]), recorded)
  assert not _same_reply(recorded, None)
  unreadable = dict(recorded, tool_calls=[call("c_0", '{"a":')])
  assert not _same_reply(unreadable, unreadable)
  assert not _same_reply(dict(recorded, tool_calls=recorded["tool_calls"] + [
      call("c_1", "{oops")]), recorded)
  # (a reviewer) Numbers a JavaScript client wrote again (JSON.parse, then stringify:
  # 30.0 as 30, 1e2 as 100) are the same values: the turn forked on every such call.
  floats = dict(recorded, tool_calls=[call("c_0", '{"timeout": 30.0, "n": 1e2, "x": 0.5}')])
  assert _same_reply(dict(floats, tool_calls=[call("c_0", '{"timeout":30,"n":100,"x":0.5}')]),
                     floats)
  assert not _same_reply(dict(floats, tool_calls=[call("c_0", '{"timeout":31,"n":100,'
                                                              '"x":0.5}')]), floats)
  # (and written into the text in a layout of the harness's own; integers stay exact)
  assert _same_reply({"role": "assistant", "content": 'ok<tool_call>{"name":"run",'
                      '"arguments":{"x":0.5,"n":1e2,"timeout":30.0}}</tool_call>'}, floats)
  big = dict(recorded, tool_calls=[call("c_0", '{"n": 12345678901234567891}')])
  assert not _same_reply(dict(big, tool_calls=[call("c_0", '{"n": 12345678901234567000}')]),
                         big)


def test_a_reply_with_a_malformed_block_written_back_as_text_is_the_one_sampled():
  """A reviewer: a reply with a good call and a malformed block (one cut by the token
  budget), sent back with its calls written into its text as the built-in agents write
  it, was read as another reply (the parse found an error): its tokens were encoded
  again, and the turn forked."""
  from jaxagent.blackbox import reply_text
  from rollout_server.chat import _same_reply

  good = {"id": "c_0", "type": "function", "function": {"name": "a", "arguments": "{}"}}
  for content in ('<tool_call>{"name":"b"', 'Go. <tool_call>{oops}</tool_call>'):
    recorded = {"role": "assistant", "content": content, "tool_calls": [good]}
    assert _same_reply({"role": "assistant", "content": reply_text(recorded)}, recorded)
    assert not _same_reply({"role": "assistant", "content": reply_text(recorded) + "!"},
                           recorded)


def test_a_reply_is_the_one_sampled_only_as_its_text_and_calls_were_sent():
  """`_same_reply` against replies a harness (or the policy's own text) changed: cut
  short, a space added, a call renamed, a call added in `tool_calls` or a malformed one in
  the text. Read as the reply sampled, the next prompt holds the sampled tokens in place
  of what the agent sent (a call it added or renamed gone from the model's context, the
  turn trained on a context no environment saw). Key order and spacing of a call's values
  written into the text are the same reply: read as another, the turn was encoded again
  from its text (a fork)."""
  from jaxagent.blackbox import reply_text
  from rollout_server.chat import _same_reply

  def call(cid, arguments, name="calculate"):
    return {"id": cid, "type": "function",
            "function": {"name": name, "arguments": arguments}}

  said = {"role": "assistant", "content": "Sure."}
  assert _same_reply(dict(said), said)
  for other in ("", "Sure", "Sure. ", " Sure."):
    assert not _same_reply(dict(said, content=other), said), other
  called = dict(said, tool_calls=[call("c_0", '{"b": 1, "a": "x"}')])
  texted = reply_text(called)
  assert _same_reply({"role": "assistant", "content": texted}, called)
  assert _same_reply({"role": "assistant", "content": reply_text(
      dict(called, tool_calls=[call("c_0", '{"a":"x","b":1}')]))}, called)
  for other in (texted.replace('"calculate"', '"calc"'),
                texted + '<tool_call>{"name": "calculate", "arguments": {oops}</tool_call>'):
    assert not _same_reply({"role": "assistant", "content": other}, called), other
  added = {"role": "assistant", "content": texted,
           "tool_calls": [call("c_9", '{"a": "y"}')]}
  assert not _same_reply(added, called)


def test_a_history_the_template_renders_otherwise_is_encoded_again():
  """`continued_prompt` continues a turn's tokens only where the call's rendering begins
  with the turn's: under a template that writes the history otherwise (here a count of
  the messages up front) the prompt was the turn's ids and then the new rendering cut at
  the old one's length (text the model never saw, and the reply's closing lost)."""
  from jaxagent.tokenizer import CHATML_TOOLS_TEMPLATE, Tokenizer
  from rollout_server.chat import continued_prompt
  from rollout_server.sessions import SessionStore

  tok = Tokenizer.byte_level("{{ messages | length }}" + CHATML_TOOLS_TEMPLATE)
  ask = [{"role": "user", "content": "go"}]
  reply = {"role": "assistant", "content": "ok"}
  store = SessionStore(8)
  _turn(store, "s", ask, tok.apply_chat_template(ask), tok.encode("ok<|im_end|>"), reply)
  follow = ask + [reply, {"role": "user", "content": "more"}]
  last = store.last_turn("s", follow, None)
  assert last is not None
  assert continued_prompt(tok, tok.render_pieces(follow), follow, None, last) is None


def test_a_reply_the_template_writes_otherwise_is_rendered_and_the_prompt_kept_as_sampled():
  """The turn's prompt ids are kept as recorded (here its text in other tokens than its
  encoding's: encoded again from the rendering, the context the reply was sampled in was
  replaced by another). Where the template writes the reply otherwise than it was sampled
  (trimmed; its reasoning dropped once it is not the last message), the call's prompt is
  the rendering after the turn's prompt: the sampled tokens continued there gave a prompt
  whose text was neither the rendering nor cut where the rest begins."""
  from jaxagent.tokenizer import CHATML_TOOLS_TEMPLATE, Tokenizer
  from rollout_server.chat import continued_prompt
  from rollout_server.sessions import SessionStore

  def next_prompt(tok, store, messages):
    return continued_prompt(tok, tok.render_pieces(messages), messages, None,
                            store.last_turn("s", messages, None))

  ask = [{"role": "user", "content": "go"}]
  tok = Tokenizer.byte_level()
  prompt = tok.encode_plain(tok.render(ask))  # (its control tokens spelled in bytes)
  assert tok.decode(prompt) == tok.render(ask) and prompt != tok.apply_chat_template(ask)
  reply = {"role": "assistant", "content": "ok"}
  store = SessionStore(8)
  _turn(store, "s", ask, prompt, tok.encode("ok<|im_end|>"), reply)
  follow = ask + [reply, {"role": "user", "content": "more"}]
  assert next_prompt(tok, store, follow)[:len(prompt) + 3] == prompt + tok.encode(
      "ok<|im_end|>")

  written = "<|im_start|>assistant\n{{ m.content or '' }}"
  assert CHATML_TOOLS_TEMPLATE.count(written) == 1
  for otherwise, content in [("{{ (m.content or '') | trim }}", " ok"), (
      "{{ m.content if loop.last else (m.content or '').split('</think>')[-1] }}",
      "<think>hm</think>ok")]:
    tok = Tokenizer.byte_level(CHATML_TOOLS_TEMPLATE.replace(
        written, "<|im_start|>assistant\n" + otherwise))
    prompt = tok.apply_chat_template(ask)
    reply = {"role": "assistant", "content": content}
    store = SessionStore(8)
    _turn(store, "s", ask, prompt, tok.encode_plain(content) + tok.encode("<|im_end|>"), reply)
    follow = ask + [reply, {"role": "user", "content": "more"}]
    got = next_prompt(tok, store, follow)
    assert got[:len(prompt)] == prompt and tok.decode(got) == tok.render(follow), content


def test_a_finished_turns_answer_and_record_are_what_it_sampled(tokenizer):
  """`ChatTurn.finish`: the answer is the text sampled less the stop token that ended it
  (kept, the agent got `<|im_end|>` in its text; a turn cut by its budget lost its last
  character), its white space before a call kept, its calls parsed; a malformed call stays
  in the text as written beside the calls read (the policy is told, as a white-box agent
  is). The record holds that answer and the errors. A turn the engine failed in or whose
  client went away is an error, never recorded as the policy's answer."""
  import pytest

  from rollout_server.chat import ChatTurn, TurnCut
  from rollout_server.engine import SamplingParams
  from rollout_server.orchestrator import Request
  from rollout_server.sessions import SessionStore

  stop = tokenizer.encode("<|im_end|>")

  def finished(text, end=stop, finish="stop", done=True, error=None):
    req = Request([1, 2], SamplingParams(max_new_tokens=64), "r1",
                  output_ids=tokenizer.encode_plain(text) + end, finish_reason=finish,
                  error=error)
    req.output_logprobs = [-1.0] * len(req.output_ids)
    if done:
      req._done.set()
    store = SessionStore(8)
    turn = ChatTurn(req, tokenizer, None, messages=[], tools=None, sessions=store,
                    session_id="s", kind="chat", id_prefix="call")
    return turn, store

  turn, store = finished("Hi there")
  assert turn.finish() == {"role": "assistant", "content": "Hi there"}
  assert finished("Hi there", [], "length")[0].finish()["content"] == "Hi there"
  good = '<tool_call>{"name": "calculate", "arguments": {"expression": "1"}}</tool_call>'
  bad = '<tool_call>{"name": "calculate", "arguments": {oops}}</tool_call>'
  turn, store = finished(f" \nSure.{good}")
  message = turn.finish()
  assert message["content"] == " \nSure." and len(message["tool_calls"]) == 1
  (record,) = store.get("s")
  assert record["response"] == message and record["output_ids"][-1:] == stop
  turn, store = finished(f"Sure.{good}{bad}")
  message = turn.finish()
  assert message["content"] == f"Sure.{bad}" and len(message["tool_calls"]) == 1
  assert message["tool_calls"][0]["function"]["name"] == "calculate"
  (record,) = store.get("s")
  assert record["response"] == message and len(record["tool_call_errors"]) == 1
  for kw, status in [({"finish": "error", "error": "boom"}, 500), ({"done": False}, 503)]:
    turn, store = finished("Hi", **kw)
    with pytest.raises(TurnCut) as cut:
      turn.finish()
    assert cut.value.status == status and store.get("s") is None, kw


def test_messages_are_normalised_to_the_text_their_parts_join_to():
  """`normalise_messages`: content sent as text parts is their texts joined as they are
  (as the Anthropic and Responses gateways join their blocks): a reply sent back in parts
  is the reply sampled, and one conversation renders alike through every gateway; joined
  with new lines, it was another reply, encoded again from its text. Only an assistant
  message that calls tools may leave its content out (another one rendered an empty
  turn the agent never sent)."""
  import pytest

  from rollout_server.chat import _same_reply, normalise_messages

  parts = [{"type": "text", "text": "Sure"}, {"text": "."}]
  (sent,) = normalise_messages([{"role": "assistant", "content": parts}])
  assert sent == {"role": "assistant", "content": "Sure."}
  assert _same_reply(sent, {"role": "assistant", "content": "Sure."})
  call = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
  assert normalise_messages([{"role": "assistant", "tool_calls": call}])[0]["content"] == ""
  for bad in ({"role": "assistant"}, {"role": "assistant", "tool_calls": []},
              {"role": "user", "tool_calls": call}, {"role": "tool", "tool_calls": call}):
    with pytest.raises(ValueError, match="has no content"):
      normalise_messages([bad])


def test_a_stream_shows_no_stop_token_half_character_or_start_of_a_call(tokenizer):
  """`ChatTurn.visible_text`, what a stream may send before the turn ends: shown, the
  stop token reached the agent as text, a character cut between its bytes as U+FFFD, and
  a call's opening tag, once sent, could not be taken back when the call came."""
  from tests.rollout_server.conftest import finished_turn

  assert finished_turn(tokenizer, "Hi there").visible_text() == "Hi there"
  for end in ("<tool_call", "<tool", "<"):
    assert finished_turn(tokenizer, "Hi " + end, "length").visible_text() == "Hi ", end
  assert finished_turn(tokenizer, "Hi <tool_call>{", "length").visible_text() == "Hi "
  turn = finished_turn(tokenizer, "Hi é", "length")
  turn.req.output_ids = turn.req.output_ids[:-1]  # (é is two bytes: one of them)
  assert turn.visible_text() == "Hi "


def test_the_tools_a_sessions_turns_offer_alike_are_stored_and_counted_once():
  """A reviewer: every turn stored and counted its whole copy of the tools (95% of a long
  episode's bytes with forty tools of an agent), and the record was evicted long before
  its context's bound. Tools the turn before offered too are its; other tools are kept."""
  from rollout_server.sessions import SessionStore, held_bytes

  tools = [{"type": "function", "function": {"name": f"tool{i}", "description": "d" * 900,
                                             "parameters": {"type": "object"}}}
           for i in range(40)]
  store = SessionStore(10)
  messages = []
  for i in range(20):
    messages += [{"role": "user", "content": f"turn {i}"}]
    _turn(store, "s", list(messages), list(range(3 * i + 3)), [7, 8],
          {"role": "assistant", "content": "ok"}, tools=json.loads(json.dumps(tools)))
    messages += [{"role": "assistant", "content": "ok"}]
  once = held_bytes(tools)  # (the record's and its thread's: not one a turn)
  assert once < store.bytes < 3 * once, (store.bytes, once)
  turns, _, _ = store.read("s", 0)
  assert all(t["tools"] == tools for t in turns)
  _turn(store, "s", list(messages), [1], [2], tools=tools[:1])  # (other tools: kept)
  _turn(store, "s", list(messages), [1], [2], tools=tools)
  assert [len(t["tools"]) for t in store.read("s", 20)[0]] == [1, 40]
  assert store.bytes == store._sessions["s"].size
