"""Turns cut while they sampled (a weight update with `update_mode: abort`, a server that
cannot go on), over HTTP against real servers on loopback ports: resumed whole where the
server can, an error and never a partial answer where it cannot."""

import threading
import time

import httpx
import openai
import pytest

from tests.rollout_server.conftest import make_engine, running_server


def client(srv):
  return httpx.Client(base_url=srv.url, timeout=120)


def test_a_chat_turn_cut_by_a_weight_update_is_resumed_whole(random_params, tokenizer):
  """`update_mode: abort` cuts running requests. A gateway turn so cut is resumed on the
  server where it stopped: the agent gets one whole turn (not a partial one to be
  scored as the policy's answer: a red-team finding), each token stamped with the
  version that sampled it, recorded once with every part's tokens and log-probs."""
  with running_server(random_params, tokenizer, version=3) as (srv, orch):
    out = {}

    def chat():
      out["r"] = client(srv).post("/v1/chat/completions", headers={"x-session-id": "s1"},
                                  json={"messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 400, "seed": 5}).json()

    t = threading.Thread(target=chat)
    t.start()
    deadline = time.time() + 60
    while orch.stats()["tokens_generated"] < 3 and time.time() < deadline:
      time.sleep(0.002)
    new = {k: v * 1.5 for k, v in random_params.items()}
    report = orch.update_weights(orch.engine.load_params(new, version=4), mode="abort")
    t.join(120)
    assert report["in_flight"] == 1
    r = out["r"]
    assert r["choices"][0]["finish_reason"] in ("stop", "length"), r
    ids, versions = r["jaxagent"]["output_ids"], r["jaxagent"]["versions"]
    assert len(ids) == len(versions) and set(versions) == {3, 4}
    assert versions == sorted(versions)  # the old version's tokens, then the new one's
    (turn,) = client(srv).get("/sessions/s1").json()["turns"]
    assert turn["output_ids"] == ids and turn["versions"] == versions
    assert len(turn["output_logprobs"]) == len(ids) and turn["resumed"] == 1
    assert turn["prompt_ids"] == r["jaxagent"]["prompt_ids"]


def test_generate_takes_a_resumed_turn_past_the_prompt_limit(random_params, tokenizer):
  """`/generate` with `resumed_tokens`: the prompt limit (max_prefill_length) does not
  count a cut turn's own tokens at the prompt's end, through the HTTP client too."""
  import asyncio

  from rollout_server.client import GenerateError, HttpClient
  from rollout_server.engine import SamplingParams

  engine = make_engine(max_prefill_length=64, max_seq_len=160)
  with running_server(random_params, tokenizer, engine=engine) as (srv, orch):
    body = {"input_ids": [7] * 70, "max_new_tokens": 3}
    r = httpx.post(f"{srv.url}/generate", json=body, timeout=120)
    assert r.status_code == 400 and "prompt is too long" in r.text
    r = httpx.post(f"{srv.url}/generate", json={**body, "resumed_tokens": 10}, timeout=120)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 3
    r = httpx.post(f"{srv.url}/generate", json={**body, "resumed_tokens": -1}, timeout=120)
    assert r.status_code == 422 and "resumed_tokens" in r.text

    async def via_client():
      client = HttpClient(srv.url)
      try:
        ok = await client.generate([7] * 70, SamplingParams(max_new_tokens=2), "s",
                                   resumed_tokens=8)
        with pytest.raises(GenerateError) as e:
          await client.generate([7] * 70, SamplingParams(max_new_tokens=2), "s")
        return ok, e.value.kind
      finally:
        await client.aclose()

    ok, kind = asyncio.run(via_client())
    assert len(ok.output_ids) == 2 and kind == "prompt_too_long"


def test_a_cut_turn_the_server_cannot_resume_is_cut_not_too_long(tokenizer):
  """Resuming resubmits the prompt with the tokens sampled so far; the engine may refuse
  that as too long (its max_prefill_length). Without the update the turn would have
  gone on: a cut turn (503), never the 400 'prompt is too long' that an agent scores
  as the policy's own length (a review finding)."""
  import asyncio

  from fastapi import HTTPException

  from rollout_server.chat import ChatTurn, TurnCut
  from rollout_server.engine import SamplingParams
  from rollout_server.orchestrator import Request

  first = Request(list(range(500)), SamplingParams(max_new_tokens=256, seed=1), "r1")
  first.output_ids, first.output_logprobs, first.versions = [65] * 40, [-0.1] * 40, [3] * 40
  first.finish_reason, first.abort_cause = "abort", "weight_update"
  first._done.set()

  def refuse(ids, sampling, resumed):
    assert len(ids) == 540 and resumed == 40 and sampling.max_new_tokens == 216
    assert sampling.seed == 1  # (the engine keys tokens by position: the seed stays)
    raise HTTPException(400, "prompt is too long: 540 tokens; the limit is 512")

  async def wait(req):
    pass

  turn = ChatTurn(first, tokenizer, None, messages=[], tools=None, sessions=None,
                  session_id="s", kind="chat", id_prefix="call", resubmit=refuse)
  with pytest.raises(TurnCut) as cut:
    asyncio.run(turn.complete(wait))
  assert cut.value.status == 503 and "could not be resumed" in str(cut.value)


def test_a_chat_turn_cut_after_every_token_is_resumed_for_as_long_as_it_samples(tokenizer):
  """A gateway turn cut by a weight update after every token is resumed to its end (a
  fixed 8 resumes made a long turn, the policy's length, a cut: an infrastructure error
  for the agent, dropped and never scored; red team 17); parts that sample nothing,
  IDLE_RESUMES in a row, end it as cut."""
  import asyncio

  from rollout_server.chat import IDLE_RESUMES, ChatTurn, TurnCut
  from rollout_server.engine import SamplingParams
  from rollout_server.orchestrator import Request

  def part(prompt, sampling, n, sampled=True):
    req = Request(list(prompt), sampling, f"r{n}")
    req.output_ids = [65] if sampled else []
    req.output_logprobs, req.versions = [-0.1] * len(req.output_ids), [n] * len(req.output_ids)
    last = sampled and sampling.max_new_tokens == 1
    req.finish_reason, req.abort_cause = ("length", None) if last else ("abort", "weight_update")
    req._done.set()
    return req

  async def wait(req):
    pass

  for idle in (0, IDLE_RESUMES - 1, IDLE_RESUMES):
    calls = {"n": 0, "idle": idle}

    def resubmit(ids, sampling, resumed):
      calls["n"] += 1
      sampled = calls["n"] <= 1 or calls["idle"] == 0
      if not sampled:
        calls["idle"] -= 1
      return part(ids, sampling, calls["n"], sampled)

    first = part([1, 2, 3], SamplingParams(max_new_tokens=20, seed=1), 0)
    turn = ChatTurn(first, tokenizer, None, messages=[], tools=None, sessions=None,
                    session_id="s", kind="chat", id_prefix="call", resubmit=resubmit)
    asyncio.run(turn.complete(wait))
    if idle < IDLE_RESUMES:
      assert len(turn.output_ids) == 20 and turn.req.finish_reason == "length", idle
    else:
      with pytest.raises(TurnCut, match=f"cut it {IDLE_RESUMES} times in a row before it"):
        turn.finish()


def test_a_chat_turn_the_server_could_not_finish_is_an_error_not_an_answer(random_params,
                                                                            tokenizer):
  """A turn the engine failed in (finish `error`) or that was aborted other than by a
  weight update answers 500 / 503, in a stream an error event the client raises, and is
  not recorded: a partial turn must not reach the environment as the policy's answer."""
  with running_server(random_params, tokenizer, version=3) as (srv, orch):
    submit, generate = orch.submit, orch.engine.generate
    cut = {"how": "fail", "now": False}

    def failing(params, state):  # (the engine's next step fails: a device failure)
      if cut["now"]:
        cut["now"] = False
        raise RuntimeError("simulated device failure")
      return generate(params, state)

    orch.engine.generate = failing

    def cutting(prompt, sampling, **kw):  # the turn is cut after its first token
      req = submit(prompt, sampling, **kw)

      def at_two(r, n):  # (after two, a random model's turn had ended once: no cut)
        if n == 1 and not r.done:
          if cut["how"] == "fail":
            cut["now"] = True  # (a listener's own error is not the loop's: a reviewer)
          else:
            orch.abort(r.request_id)  # an explicit abort (POST /abort does the same)

      req.add_listener(at_two)
      return req

    orch.submit = cutting
    # (seeded: unseeded, a random model's turn sometimes ended at its first token, uncut)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 300, "seed": 1}
    r = client(srv).post("/v1/chat/completions", headers={"x-session-id": "s2"}, json=body)
    assert r.status_code == 500 and "engine failed" in r.text
    oai = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
    with pytest.raises(openai.APIError, match="engine failed"):
      for _ in oai.chat.completions.create(model="m", stream=True, extra_headers={
          "x-session-id": "s2"}, **body):
        pass
    cut["how"] = "abort"
    r = client(srv).post("/v1/chat/completions", headers={"x-session-id": "s2"}, json=body)
    assert r.status_code == 503 and "aborted" in r.text
    assert client(srv).get("/sessions/s2").status_code == 404  # nothing was recorded


def test_a_resumed_part_with_the_same_seed_goes_on_as_the_uncut_turn(random_params, tokenizer):
  """The engine keys a token by its position, so a turn cut after k tokens and resumed
  (`resumed_tokens`) with the same seed samples what the uncut turn did under the same
  weights; the resume moved the seed on by k before, and seeded turns cut by an update
  differed (red team 113)."""
  with running_server(random_params, tokenizer) as (srv, orch):
    body = {"input_ids": [7, 8, 9, 10], "max_new_tokens": 16, "temperature": 1.0,
            "seed": 123, "record": False}
    whole = httpx.post(f"{srv.url}/generate", json=body, timeout=120).json()
    assert len(whole["output_ids"]) == 16
    for k in (1, 5, 11):
      part = httpx.post(f"{srv.url}/generate", timeout=120, json={
          **body, "input_ids": body["input_ids"] + whole["output_ids"][:k],
          "resumed_tokens": k, "max_new_tokens": 16 - k}).json()
      assert part["output_ids"] == whole["output_ids"][k:], k
      assert part["output_logprobs"] == pytest.approx(whole["output_logprobs"][k:], abs=1e-5)


def test_a_turn_resumed_twice_is_recorded_once_as_every_part_sampled_it(tokenizer):
  """Each part of a turn cut by weight updates is resumed from the prompt and every token
  sampled so far (not the last part's alone: a prompt missing the earlier parts' tokens,
  and a `resumed_tokens` the engine keys a seeded turn's tokens by, off), and the whole
  turn is one record: every part's tokens, log-probs, raw log-probs and versions aligned,
  the first part's prompt and id, the last part's finish, asked for twice and recorded
  once (a second record trained the turn twice)."""
  import asyncio

  from rollout_server.chat import ChatTurn
  from rollout_server.engine import SamplingParams
  from rollout_server.orchestrator import Request
  from rollout_server.sessions import SessionStore

  tokens = tokenizer.encode("Hi there") + tokenizer.encode("<|im_end|>")
  cuts, seen = [3, 5, len(tokens)], []

  def part(prompt, sampling, n):
    start = len(prompt) - 2
    req = Request(list(prompt), sampling, f"r{n}")
    req.output_ids = tokens[start:cuts[n]]
    req.output_logprobs = [-0.5 - i for i in range(start, cuts[n])]
    req.raw_logprobs = [-1.5 - i for i in range(start, cuts[n])]
    req.versions = [n] * len(req.output_ids)
    last = n == len(cuts) - 1
    req.finish_reason, req.abort_cause = ("stop", None) if last else ("abort", "weight_update")
    req._done.set()
    return req

  def resubmit(ids, sampling, resumed):
    seen.append((list(ids), sampling.max_new_tokens, sampling.seed, resumed))
    return part(ids, sampling, len(seen))

  async def wait(req):
    pass

  store = SessionStore(8)
  first = part([1, 2], SamplingParams(max_new_tokens=40, seed=7), 0)
  turn = ChatTurn(first, tokenizer, None, messages=[{"role": "user", "content": "hi"}],
                  tools=None, sessions=store, session_id="s", kind="chat", id_prefix="call",
                  resubmit=resubmit)
  asyncio.run(turn.complete(wait))
  assert seen == [([1, 2] + tokens[:3], 37, 7, 3), ([1, 2] + tokens[:5], 35, 7, 5)]
  assert turn.prompt_ids == [1, 2] and turn.output_ids == tokens
  assert turn.finish_reason == "stop" and turn.max_new_tokens == 40
  assert turn.output_logprobs == [-0.5 - i for i in range(len(tokens))]
  assert turn.versions == [0] * 3 + [1] * 2 + [2] * (len(tokens) - 5)
  assert turn.finish() == {"role": "assistant", "content": "Hi there"}
  assert turn.finish() == {"role": "assistant", "content": "Hi there"}
  (record,) = store.get("s")
  assert record["prompt_ids"] == [1, 2] and record["output_ids"] == tokens
  assert record["output_logprobs"] == turn.output_logprobs
  assert record["raw_logprobs"] == [-1.5 - i for i in range(len(tokens))]
  assert record["versions"] == turn.versions and record["finish_reason"] == "stop"
  assert record["resumed"] == 2 and record["part_ids"] == ["r0", "r1", "r2"]
  assert record["request_id"] == "r0" and turn.recorded == (turn.recorded[0], 0)
  assert record["response"] == {"role": "assistant", "content": "Hi there"}
