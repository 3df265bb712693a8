"""Black-box agents (OpenAI, Anthropic and Responses harnesses, a harness of your own)
through the real gateway: how their episodes are cut, judged and trained."""

import asyncio
import dataclasses
import os

import pytest

from envs.base import TaskSpec, make
from jaxagent.agent import run_whitebox
from jaxagent.blackbox import run_blackbox
from jaxagent.config import AgentConfig
from jaxagent.errors import TaskError
from jaxagent.tokenizer import Tokenizer
from tests.test_agent import TOK, UNGUESSABLE, SlowEnv


@pytest.mark.parametrize("kind", ["blackbox"])
def test_blackbox_openai_agent_through_the_gateway(kind, random_params):
  from tests.rollout_server.conftest import running_server

  with running_server(random_params, TOK, version=9) as (srv, _):
    task = TaskSpec("t", "guess_number", {"secret": 3, "max_turns": 3})
    ep = asyncio.run(run_blackbox(make("guess_number"), task, srv.url,
                                  AgentConfig(max_turns=3, max_new_tokens=3),
                                  session_id="bb-1", group_id="g"))
  assert not ep.infra_error, ep.reason
  assert ep.turns == len(ep.turn_rewards) >= 1
  seg = ep.segments[0]
  assert seg.session_id == "bb-1" and seg.num_action_tokens > 0
  assert set(seg.versions[seg.loss_mask > 0].tolist()) == {9}
  # The trajectory is the server's record: outputs are exactly what was sampled.
  assert seg.rollout_logp[seg.loss_mask > 0].max() <= 0.0


def test_a_blackbox_agent_that_runs_out_the_clock_is_trained_as_a_fail(random_params):
  """The episode deadline passing in the environment (the policy's own slow tool calls):
  a scored truncation whose played turns are trained with outcome 0 (before, the
  episode left no segments: stalling hid a failure from the loss), and with the process
  rewards its steps earned, as a white-box episode's are (they were zeroed)."""
  from tests.rollout_server.conftest import running_server

  with running_server(random_params, TOK, version=4) as (srv, _):
    task = TaskSpec("t", "guess_number", {**UNGUESSABLE, "max_turns": 8})
    config = AgentConfig(max_turns=8, max_new_tokens=3, episode_deadline_s=60)
    # A first episode compiles the server's shapes, so turns then take milliseconds.
    asyncio.run(run_blackbox(make("guess_number"), task, srv.url, config,
                             session_id="bb-warm", group_id="g"))
    # Steps of 2 s against an 8 s deadline: a few turns (the agent's client takes up to
    # a second to start on a busy machine, and its turns as long: with 1 s steps against
    # 4 s, a full suite's load once put more of the time on the server's side, which is
    # the infrastructure's), then the deadline, in the environment.
    ep = asyncio.run(run_blackbox(SlowEnv(2.0, process_reward=0.25), task, srv.url,
                                  dataclasses.replace(config, episode_deadline_s=8.0),
                                  session_id="bb-slow", group_id="g"))
  assert (ep.status, ep.reason) == ("truncated", "episode_deadline") and not ep.infra_error, ep
  assert ep.verdict["status"] == "fail" and ep.turns >= 1 and ep.segments
  steps = ep.turn_rewards.count(0.25)  # those that ended before the cut
  assert ep.turn_rewards == [0.25] * steps + [0.0] * (ep.turns - steps), ep.turn_rewards
  assert steps >= 1 and ep.reward == 0.25 * steps
  assert sum(s.num_action_tokens for s in ep.segments) > 0
  assert all(s.reward == ep.reward for s in ep.segments)


def test_a_conversation_that_outgrows_the_engine_is_the_policys_truncation(random_params):
  """An engine that takes shorter prompts than agent.max_context_tokens refuses a turn
  once the conversation outgrows it: that is the policy's length, a scored truncation
  (before: an infrastructure error, so every episode that ran long was re-rolled; a
  red-team finding), through the in-process client and through the gateway alike."""
  from rollout_server.client import LocalClient
  from tests.rollout_server.conftest import make_engine, running_server

  task = TaskSpec("t", "guess_number", {**UNGUESSABLE, "max_turns": 8})
  config = AgentConfig(max_turns=8, max_new_tokens=3)  # max_context_tokens 1024
  with running_server(random_params, TOK, version=4,
                      engine=make_engine(max_prefill_length=64)) as (srv, orch):
    white = asyncio.run(run_whitebox(make("guess_number"), task,
                                     LocalClient(orch, orch.engine), TOK, config,
                                     session_id="wb", group_id="g"))
    black = asyncio.run(run_blackbox(make("guess_number"), task, srv.url, config,
                                     session_id="bb", group_id="g"))
    # (an environment whose wrong answers pay -1 says a cut pays -1: `Env.cut_reward`)
    harsh = make("guess_number")
    harsh.cut_reward = -1.0
    black_harsh = asyncio.run(run_blackbox(harsh, task, srv.url, config,
                                           session_id="bb-harsh", group_id="g"))
  for ep in (white, black):
    assert (ep.status, ep.reason) == ("truncated", "token_cap") and not ep.infra_error
    assert ep.reward == 0.0 and 1 <= ep.turns < 8
    assert sum(s.num_action_tokens for s in ep.segments) > 0
  assert (black_harsh.status, black_harsh.reason) == ("truncated", "token_cap")
  assert black_harsh.verdict["reward"] == -1.0 and black_harsh.reward == -1.0
  assert black_harsh.turn_rewards[-1] == -1.0 and set(black_harsh.turn_rewards[:-1]) <= {0.0}
  assert all(s.reward == -1.0 for s in black_harsh.segments)


@pytest.mark.parametrize("api", ["openai", "anthropic", "responses",
                                 "examples/own_agent.py:run_agent"])
def test_a_blackbox_agent_must_sample_as_the_run_trains(random_params, api, monkeypatch):
  """The built-in agents pass the run's temperature, top_p and top_k, and the record
  says so; a harness that samples its own way (greedy: log-prob 0 for every token, a
  red-team finding) stops the run with the turn and values named, instead of training
  on another distribution's log-probs."""
  from jaxagent import blackbox as blackbox_mod
  from jaxagent.blackbox import SamplingMismatch
  from tests.rollout_server.conftest import running_server

  task = TaskSpec("t", "guess_number", {"secret": 3, "max_turns": 2})
  config = AgentConfig(max_turns=2, max_new_tokens=3, temperature=0.8, top_p=0.9, top_k=50)
  with running_server(random_params, TOK, version=4) as (srv, _):
    ep = asyncio.run(run_blackbox(make("guess_number"), task, srv.url, config,
                                  session_id="bb-ok", group_id="g", api=api))
    assert not ep.infra_error and ep.segments, ep.reason
    assert ep.segments[0].meta_versions["sampling"]["top_k"] == 50
    own_way = blackbox_mod.blackbox_agent(api)  # (a harness of your own too: the example)

    async def greedy(*args, **kw):
      return await own_way(*args, **{**kw, "temperature": 0.0})

    monkeypatch.setitem(blackbox_mod.BLACKBOX_AGENTS, api, greedy)
    with pytest.raises(SamplingMismatch, match="turn 0 of black-box session bb-greedy.*0.0"):
      asyncio.run(run_blackbox(make("guess_number"), task, srv.url, config,
                               session_id="bb-greedy", group_id="g", api=api))


def test_a_blackbox_best_of_two_trains_the_reply_it_acted_on(random_params, monkeypatch):
  """A harness that samples its last step twice and hands the environment the first
  reply: that reply trains, the other does not (a review finding: the last recorded one
  trained, whichever the agent used)."""
  import openai

  from jaxagent import blackbox as blackbox_mod
  from tests.rollout_server.conftest import running_server

  async def best_of_two(env, task, base_url, *, session_id, max_tokens, temperature,
                        top_p, top_k, **_):
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                                default_headers={"X-Session-Id": session_id})
    obs = await env.reset(task)
    replies = [(await client.chat.completions.create(
        model="policy", messages=obs.messages, max_tokens=max_tokens, temperature=temperature,
        top_p=top_p, seed=seed, extra_body={"top_k": top_k})).choices[0].message.content
        for seed in (1, 2)]
    await env.step(replies[0])
    await client.close()
    return [0.0]

  monkeypatch.setitem(blackbox_mod.BLACKBOX_AGENTS, "openai", best_of_two)
  task = TaskSpec("t", "guess_number", {"secret": 3, "max_turns": 1})
  with running_server(random_params, TOK, version=4) as (srv, _):
    ep = asyncio.run(run_blackbox(make("guess_number"), task, srv.url,
                                  AgentConfig(max_turns=1, max_new_tokens=8),
                                  session_id="bb-best", group_id="g", tokenizer=TOK))
  assert not ep.infra_error, ep.reason
  trained = [s for s in ep.segments if s.num_action_tokens]
  (seg,) = trained
  first, second = [s for s in ep.segments]
  assert seg is first and second.num_action_tokens == 0


def test_a_blackbox_episode_whose_record_the_server_dropped_is_the_infrastructures(
    random_params, monkeypatch):
  """A server whose session store dropped the session while its agent played (here its
  count bound: another session's call came between two steps) holds only the later
  turns: the episode is dropped as the infrastructure's `session_evicted`, not trained
  as the later turns alone with the first step's reward on them (a reviewer)."""
  import httpx

  from jaxagent import blackbox as blackbox_mod
  from tests.rollout_server.conftest import running_server

  honest = blackbox_mod.BLACKBOX_AGENTS["openai"]

  class Crowded:
    """The environment, with another session's call after its first step."""

    def __init__(self, env, url):
      self.env, self.url, self.steps = env, url, 0

    def __getattr__(self, name):
      return getattr(self.env, name)

    async def step(self, action):
      out = await self.env.step(action)
      self.steps += 1
      if self.steps == 1:
        async with httpx.AsyncClient() as c:
          r = await c.post(f"{self.url}/v1/chat/completions",
                           headers={"X-Session-Id": "another"},
                           json={"model": "policy", "max_tokens": 2,
                                 "messages": [{"role": "user", "content": "hi"}]})
          assert r.status_code == 200, r.text
      return out

  async def crowded(env, task, base_url, **kw):
    return await honest(Crowded(env, base_url), task, base_url, **kw)

  monkeypatch.setitem(blackbox_mod.BLACKBOX_AGENTS, "openai", crowded)
  task = TaskSpec("t", "guess_number", {**UNGUESSABLE, "max_turns": 3})
  config = AgentConfig(max_turns=3, max_new_tokens=3)
  with running_server(random_params, TOK, version=4, max_sessions=1) as (srv, _):
    ep = asyncio.run(run_blackbox(make("guess_number"), task, srv.url, config,
                                  session_id="bb-dropped", group_id="g"))
  assert ep.infra_error and ep.infra_kind == "session_evicted", (ep.status, ep.reason)
  assert "by its count bound" in ep.reason and "serving.max_sessions" in ep.reason
  assert not ep.segments


class _Titled:
  """An environment whose every step a side call of the session's comes before (a
  harness asking for a title: a gateway call that is no step)."""

  def __init__(self, env, url, session_id):
    self.env, self.url, self.session_id = env, url, session_id

  def __getattr__(self, name):
    return getattr(self.env, name)

  async def step(self, action):
    import httpx

    async with httpx.AsyncClient() as c:
      r = await c.post(f"{self.url}/v1/chat/completions",
                       headers={"X-Session-Id": self.session_id},
                       json={"model": "policy", "max_tokens": 2, "temperature": 1.0,
                             "messages": [{"role": "user", "content": "A title?"}]})
      assert r.status_code == 200, r.text
    return await self.env.step(action)


def _titling(harness):
  """`harness`, its environment's every step after a side call (`_Titled`)."""
  async def titled(env, task, base_url, *, session_id, **kw):
    return await harness(_Titled(env, base_url, session_id), task, base_url,
                         session_id=session_id, **kw)
  return titled


def test_a_cut_blackbox_episodes_turn_rewards_are_its_steps_not_its_calls(random_params,
                                                                          monkeypatch):
  """A black-box episode cut by its deadline in its environment, with a side call at each
  step: its per-turn rewards are one for each step its turns make (the step the cut
  stopped scored 0), as the white-box agent's. Padded to its gateway calls, the side
  calls made steps that never were, and the chunk estimator's baseline counted them (a
  reviewer)."""
  from jaxagent import blackbox as blackbox_mod
  from tests.rollout_server.conftest import running_server

  monkeypatch.setitem(blackbox_mod.BLACKBOX_AGENTS, "openai",
                      _titling(blackbox_mod.BLACKBOX_AGENTS["openai"]))
  task = TaskSpec("t", "guess_number", {**UNGUESSABLE, "max_turns": 8})
  config = AgentConfig(max_turns=8, max_new_tokens=3, episode_deadline_s=60)
  with running_server(random_params, TOK, version=4) as (srv, _):
    asyncio.run(run_blackbox(make("guess_number"), task, srv.url, config,  # (compiles)
                             session_id="bb-warm", group_id="g"))
    ep = asyncio.run(run_blackbox(SlowEnv(2.0, process_reward=0.25), task, srv.url,
                                  dataclasses.replace(config, episode_deadline_s=8.0),
                                  session_id="bb-slow", group_id="g"))
  assert (ep.status, ep.reason) == ("truncated", "episode_deadline") and not ep.infra_error, ep
  # (a side call after the last reply handed, its step in flight, is of the step after)
  steps = max(int(s.turn_ids.max()) for s in ep.segments) + 1
  assert len(ep.turn_rewards) == steps < ep.turns, (ep.turn_rewards, ep.turns)
  earned = ep.turn_rewards.count(0.25)
  assert earned >= 1 and ep.turn_rewards == [0.25] * earned + [0.0] * (steps - earned)


def test_a_blackbox_episodes_truncation_is_its_environments_and_its_steps_not_its_calls(
    random_params, monkeypatch):
  """An episode whose environment cut it (guess_number's own turn budget) is truncated
  with the environment's reason, as the white-box agent's; and the turn cap counts the
  agent's steps, not its gateway calls: with a side call (a title) at each step, an
  episode the environment ended at 2 of 4 turns was read as cut by the turn cap, and
  without side calls as completed."""
  from jaxagent import blackbox as blackbox_mod
  from tests.rollout_server.conftest import running_server

  honest = blackbox_mod.BLACKBOX_AGENTS["openai"]
  titled = _titling(honest)
  with running_server(random_params, TOK, version=4) as (srv, _):
    def play(agent, env_turns, max_turns):
      monkeypatch.setitem(blackbox_mod.BLACKBOX_AGENTS, "openai", agent)
      task = TaskSpec("t", "guess_number", {**UNGUESSABLE, "max_turns": env_turns})
      ep = asyncio.run(run_blackbox(make("guess_number"), task, srv.url,
                                    AgentConfig(max_turns=max_turns, max_new_tokens=3),
                                    session_id=f"bb-cap-{env_turns}", group_id="g"))
      assert not ep.infra_error, ep.reason
      return ep.status, ep.reason, ep.turns

    assert play(titled, 2, 4) == ("truncated", "turn_budget", 4)
    assert play(honest, 2, 4) == ("truncated", "turn_budget", 2)
    assert play(titled, 8, 2) == ("truncated", "turn_cap", 4)


@pytest.mark.parametrize("damage", ["no_logprobs", "ids_as_text", "short_versions",
                                    "not_a_turn", "not_a_list"])
def test_a_blackbox_episode_whose_record_is_no_record_is_the_infrastructures(
    random_params, monkeypatch, damage):
  """A gateway whose record of the session is damaged (a server's or a router's bug, or
  another gateway): the episode is dropped as the infrastructure's, naming the turn and
  what is wrong; it stopped the run as the episode's bug (KeyError, TypeError)."""
  from rollout_server.sessions import SessionStore
  from tests.rollout_server.conftest import running_server

  read = SessionStore.read

  def damaged(self, session_id, since=0):
    got = read(self, session_id, since)
    if got is None or not got[0]:
      return got
    turns = got[0]
    if damage == "no_logprobs":
      del turns[-1]["output_logprobs"]
    elif damage == "ids_as_text":
      turns[-1]["prompt_ids"] = "abc"
    elif damage == "short_versions":
      turns[-1]["versions"] = turns[-1]["versions"][:-1] if turns[-1]["versions"] else [1]
    elif damage == "not_a_turn":
      turns.append(7)
    else:
      turns = {"0": turns[0]}
    return turns, got[1], got[2]

  task = TaskSpec("t", "guess_number", {**UNGUESSABLE, "max_turns": 2})
  config = AgentConfig(max_turns=2, max_new_tokens=3)
  with running_server(random_params, TOK, version=4) as (srv, _):
    monkeypatch.setattr(SessionStore, "read", damaged)
    ep = asyncio.run(run_blackbox(make("guess_number"), task, srv.url, config,
                                  session_id="bb-damaged", group_id="g"))
  assert ep.infra_error and ep.infra_kind == "server", (ep.status, ep.reason)
  assert "record of session" in ep.reason and not ep.segments
  assert ("not a list of turns" if damage == "not_a_list" else "is no turn") in ep.reason


def test_a_record_that_is_not_the_whole_episode_at_a_cut_is_the_infrastructures(
    random_params, monkeypatch):
  """An episode cut by its deadline whose record, taken at the cut, says its first turns
  were dropped: the infrastructure's `session_evicted`, as at the episode's end (the
  error was not caught there, and stopped the run; red team 67)."""
  from rollout_server.sessions import SessionStore
  from tests.rollout_server.conftest import running_server

  read = SessionStore.read

  def evicted(self, session_id, since=0):
    got = read(self, session_id, since)
    if got is not None and got[0]:
      got[0][0]["lost_before"] = {"reason": "bytes", "turns": 3}
    return got

  task = TaskSpec("t", "guess_number", {**UNGUESSABLE, "max_turns": 8})
  config = AgentConfig(max_turns=8, max_new_tokens=3, episode_deadline_s=3.0)
  with running_server(random_params, TOK, version=4) as (srv, _):
    import httpx  # (compiled first: a compile under load took the episode's 3 s, and
    # the cut came before any turn was recorded)
    httpx.post(f"{srv.url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "warm"}], "max_tokens": 3})
    monkeypatch.setattr(SessionStore, "read", evicted)
    ep = asyncio.run(run_blackbox(SlowEnv(1.0), task, srv.url, config,
                                  session_id="bb-cut", group_id="g"))
  assert ep.infra_error and ep.infra_kind == "session_evicted", (ep.status, ep.reason)
  assert "serving.session_max_bytes" in ep.reason and not ep.segments


def test_a_harness_cannot_reach_a_siblings_session_nor_forge_its_rewards(random_params,
                                                                        monkeypatch):
  """Red team 29: the scheduler's session ids are predictable (`g<group>-<i>-r<attempt>`),
  and an agent that posted turns under its sibling's id had them trained with the
  sibling's reward; a harness that returned [1000.0] for a step the environment gave 0
  had that trained. A harness now plays under a session id with a secret part, and the
  rewards trained are the environment's."""
  import httpx

  from jaxagent import blackbox as blackbox_mod
  from tests.rollout_server.conftest import running_server

  honest, ids = blackbox_mod.BLACKBOX_AGENTS["openai"], []

  async def beside_an_intruder(env, task, base_url, *, session_id, **kw):
    """The sibling's honest harness, its session cleared and playing, while another
    episode's agent posts a turn under the sibling's predictable id."""
    ids.append(session_id)
    r = httpx.post(f"{base_url}/v1/chat/completions",
                   headers={"X-Session-Id": session_id.partition("~")[0]},
                   json={"model": "policy", "max_tokens": 4,
                         "messages": [{"role": "user", "content": "injected"}]})
    assert r.status_code == 200, r.text
    await honest(env, task, base_url, session_id=session_id, **kw)
    return [1000.0]  # (and a reward the environment never gave)

  monkeypatch.setitem(blackbox_mod.BLACKBOX_AGENTS, "openai", beside_an_intruder)
  task = TaskSpec("t", "guess_number", {"secret": 3, "max_turns": 1})
  config = AgentConfig(max_turns=1, max_new_tokens=4)
  with running_server(random_params, TOK, version=4) as (srv, _):
    ep = asyncio.run(run_blackbox(make("guess_number"), task, srv.url, config,
                                  session_id="g0-1-r0", group_id="g0", tokenizer=TOK))
    intruders = httpx.get(f"{srv.url}/sessions/g0-1-r0").status_code
  assert not ep.infra_error, ep.reason
  assert all("injected" not in TOK.decode(s.tokens.tolist()) for s in ep.segments)
  assert ep.session_id == "g0-1-r0" and ep.turns == 1 and len(ep.segments) == 1
  assert ep.turn_rewards[0] <= 1.0
  (wire,) = ids
  assert wire.startswith("g0-1-r0~") and len(wire) == len("g0-1-r0~") + 24
  assert intruders == 200  # (the intruder's turn is a session of its own, trained by no one)


def test_a_blackbox_episode_cut_while_the_gateway_was_slow_is_infrastructure(random_params):
  """A server that takes 1.5 s a turn against a 2.5 s deadline: the time went to the
  gateway, not the environment, so the episode is dropped as infrastructure, as
  run_whitebox does (before, it was a truncation trained with reward 0; red team)."""
  import time as time_mod

  from tests.rollout_server.conftest import running_server

  task = TaskSpec("t", "guess_number", {**UNGUESSABLE, "max_turns": 8})
  config = AgentConfig(max_turns=8, max_new_tokens=3, episode_deadline_s=60)
  with running_server(random_params, TOK, version=4) as (srv, orch):
    asyncio.run(run_blackbox(make("guess_number"), task, srv.url, config,  # compiles
                             session_id="bb-warm", group_id="g"))
    submit = orch.submit

    def slow_submit(*args, **kw):
      time_mod.sleep(1.5)
      return submit(*args, **kw)

    orch.submit = slow_submit
    ep = asyncio.run(run_blackbox(make("guess_number"), task, srv.url,
                                  dataclasses.replace(config, episode_deadline_s=2.5),
                                  session_id="bb-slow-server", group_id="g"))
    orch.submit = submit
    # A turn that does not move for agent.turn_deadline_s (an engine stuck before its
    # first token): the harness gives up, as the built-in agent does (its openai client
    # waited 600 s).
    emit = orch._emit
    orch._emit = lambda *args: (time_mod.sleep(2.0), emit(*args))[1]
    try:
      slow_turn = asyncio.run(run_blackbox(make("guess_number"), task, srv.url,
                                           dataclasses.replace(config, turn_deadline_s=0.5),
                                           session_id="bb-slow-turn", group_id="g"))
    finally:
      orch._emit = emit
  assert ep.infra_error and ep.infra_kind == "episode_deadline", (ep.status, ep.reason)
  assert "on the gateway" in ep.reason and not ep.segments
  assert slow_turn.infra_error and slow_turn.infra_kind == "turn_deadline", slow_turn.reason


def test_a_blackbox_episode_cut_while_its_own_tokens_decoded_is_the_policys(random_params):
  """The server's time from a turn's first token to its end is the policy's side of a
  cut: a policy that writes to its token cap on a busy server must not turn its long
  failures into re-rolled infrastructure errors (red team: the time was all the
  server's). Decoding slowed to 0.3 s a token, 6 tokens a turn, a 4 s deadline; the
  turn in flight at the cut counts too (the server says how long it has decoded, to
  its latest token)."""
  import time as time_mod

  from tests.rollout_server.conftest import running_server

  task = TaskSpec("t", "guess_number", {**UNGUESSABLE, "max_turns": 8})
  config = AgentConfig(max_turns=8, max_new_tokens=3, episode_deadline_s=60)
  with running_server(random_params, TOK, version=4) as (srv, orch):
    for n in (6, 20):  # compiles the shapes below (a cut turn's time is the margin)
      asyncio.run(run_blackbox(make("guess_number"), task, srv.url,
                               dataclasses.replace(config, max_new_tokens=n),
                               session_id=f"bb-warm-{n}", group_id="g"))
    emit = orch._emit

    def slow_emit(req, *args):
      if req.first_token_at is not None:  # the tokens after the first: its length's time
        time_mod.sleep(0.3)
      return emit(req, *args)

    orch._emit = slow_emit
    try:
      ep = asyncio.run(run_blackbox(make("guess_number"), task, srv.url,
                                    dataclasses.replace(config, episode_deadline_s=4.0,
                                                        max_new_tokens=6),
                                    session_id="bb-long", group_id="g"))
      # One turn of 20 tokens, cut in flight: no turn recorded yet, its time the policy's.
      first = asyncio.run(run_blackbox(make("guess_number"), task, srv.url,
                                       dataclasses.replace(config, episode_deadline_s=4.0,
                                                           max_new_tokens=20),
                                       session_id="bb-first", group_id="g"))
      # Turns of 0.6 s against a 0.5 s turn deadline: they move, so the harness waits.
      moving = asyncio.run(run_blackbox(make("guess_number"), task, srv.url,
                                        dataclasses.replace(config, turn_deadline_s=0.5,
                                                            max_turns=2),
                                        session_id="bb-moving", group_id="g"))
    finally:
      orch._emit = emit
  assert (ep.status, ep.reason) == ("truncated", "episode_deadline"), (ep.status, ep.reason)
  assert not ep.infra_error and ep.reward == 0.0 and ep.segments and ep.decode_s > 2.0
  assert (first.status, first.reason) == ("truncated", "episode_deadline"), first.reason
  assert not first.infra_error and first.reward == 0.0 and first.decode_s > 2.0
  assert not moving.infra_error and moving.turns == 2, (moving.status, moving.reason)


def test_a_slow_servers_turns_that_keep_moving_finish_and_a_stuck_one_is_infrastructure(
    random_params):
  """Through a real server and router: a turn whose tokens come 0.3 s apart against a
  0.25 s turn deadline is waited on (`GET /requests/{id}` says it moves) and the
  episode plays on; a server stuck before its first token is a turn_deadline infra
  error after two looks."""
  import threading
  import time as time_mod

  from rollout_server.client import HttpClient
  from rollout_server.router import create_router
  from rollout_server.serving import ServerThread
  from tests.rollout_server.conftest import running_server

  task = TaskSpec("t", "guess_number", {**UNGUESSABLE, "max_turns": 2})
  config = AgentConfig(max_turns=2, max_new_tokens=3, turn_deadline_s=0.25)
  with running_server(random_params, TOK, version=4) as (srv, orch), \
      ServerThread(create_router([srv.url])) as router:
    async def episode(session_id, url, config=config):
      client = HttpClient(url)
      try:
        return await run_whitebox(make("guess_number"), task, client, TOK, config,
                                  session_id=session_id, group_id="g")
      finally:
        await client.aclose()

    for warm in ("warm", "warm-cached"):  # compiles (a prefix cache hit's shapes too)
      asyncio.run(episode(warm, srv.url, dataclasses.replace(config, turn_deadline_s=60)))
    emit, stuck = orch._emit, threading.Event()

    def slow_emit(req, *args):
      if stuck.is_set():
        time_mod.sleep(2.0)
      elif req.first_token_at is not None:
        time_mod.sleep(0.3)
      return emit(req, *args)

    orch._emit = slow_emit
    try:
      slow = asyncio.run(episode("slow", srv.url))
      routed = asyncio.run(episode("routed", router.url))
      blackbox = asyncio.run(run_blackbox(make("guess_number"), task, router.url, config,
                                          session_id="routed-bb", group_id="g"))
      stuck.set()
      cut = asyncio.run(episode("stuck", srv.url))
    finally:
      orch._emit = emit
  for ep in (slow, routed, blackbox):
    assert not ep.infra_error and ep.turns == 2, (ep.status, ep.reason)
    assert ep.output_tokens > 2
  assert cut.infra_error and cut.infra_kind == "turn_deadline", (cut.status, cut.reason)


def test_a_task_that_cannot_start_is_a_task_error_for_every_agent(random_params):
  """Parameters of the wrong type are the task's fault for the black-box harness too
  (it raised the TypeError itself, read as a bug; review)."""
  from rollout_server.client import LocalClient
  from tests.rollout_server.conftest import running_server

  bad = TaskSpec("t", "guess_number", {"low": [1]})
  config = AgentConfig(max_turns=1, max_new_tokens=4)
  with running_server(random_params, TOK, version=4) as (srv, orch):
    # (with where it was raised: an environment's own bug in reset reads the same)
    with pytest.raises(TaskError, match="task 't' \\(guess_number\\): "
                                        "envs/guess_number.py:\\d+: ValueError: task t: "
                                        "low must be an integer"):
      asyncio.run(run_blackbox(make("guess_number"), bad, srv.url, config,
                               session_id="bad-bb", group_id="g"))
    with pytest.raises(TaskError, match="low must be an integer"):
      asyncio.run(run_whitebox(make("guess_number"), bad, LocalClient(orch, orch.engine), TOK,
                               config, session_id="bad-wb", group_id="g"))


@pytest.mark.parametrize("api", ["openai", "anthropic", "responses",
                                 "examples/own_agent.py:run_agent"])
def test_a_blackbox_episode_is_played_again_the_same_under_its_session_id(random_params,
                                                                          api):
  """A reviewer: the built-in harnesses sent no seed, so the gateway drew one per turn
  and an evaluation of a black-box run gave other figures each time (eval says its
  reports are reproducible). Each turn is seeded by its session and turn, as the
  built-in agent's are."""
  from tests.rollout_server.conftest import running_server

  task = TaskSpec("t", "guess_number", {**UNGUESSABLE, "max_turns": 2})
  config = AgentConfig(max_turns=2, max_new_tokens=6, temperature=1.0)
  with running_server(random_params, TOK, version=4) as (srv, _):
    played = [asyncio.run(run_blackbox(make("guess_number"), task, srv.url, config,
                                       session_id="eval-t-0", group_id="g", api=api))
              for _ in range(2)]
  assert all(not ep.infra_error and ep.segments for ep in played), played[0].reason
  first, again = ([s.tokens.tolist() for s in ep.segments] for ep in played)
  assert first == again


def test_a_record_made_anew_while_its_episode_played_is_the_infrastructures(
    random_params, monkeypatch):
  """A reviewer: a flood of other sessions dropped an idle episode's record, and past
  the store's bounded marks of what it dropped its next turn began a record anew that
  said nothing: its later turns alone were trained as the whole episode, their rewards
  on the wrong turns. The record's id at the first step and at the end must agree (here
  the record is deleted after the first step, as a drop past the marks leaves it)."""
  import httpx

  from jaxagent import blackbox as blackbox_mod
  from tests.rollout_server.conftest import running_server

  own_way = blackbox_mod.blackbox_agent("openai")

  task = TaskSpec("t", "guess_number", {**UNGUESSABLE, "max_turns": 3})
  config = AgentConfig(max_turns=3, max_new_tokens=3)
  with running_server(random_params, TOK, version=4) as (srv, _):
    async def dropping(env, task, base_url, *, session_id, **kw):
      async def step(action, _step=env.step):
        result = await _step(action)
        if len(env.actions) == 1:  # (after the first step's record was seen)
          httpx.delete(f"{base_url}/sessions/{session_id}")
        return result

      env.step = step
      return await own_way(env, task, base_url, session_id=session_id, **kw)

    monkeypatch.setitem(blackbox_mod.BLACKBOX_AGENTS, "openai", dropping)
    ep = asyncio.run(run_blackbox(make("guess_number"), task, srv.url, config,
                                  session_id="bb-flooded", group_id="g", api="openai"))
  assert ep.infra_error and ep.infra_kind == "session_evicted", (ep.reason, ep.turns)
  assert "was made anew while its episode played" in ep.reason


def test_a_blackbox_episode_starts_its_session_afresh(random_params):
  """Turns an attempt recorded under a session id before it died (a run killed and
  resumed plays its groups under the same ids, on a server that outlived it) are not
  this episode's: the red team had the dead attempt's tool call trained with the new
  attempt's reward, and the new reply left out as an abandoned sibling."""
  import httpx

  from tests.rollout_server.conftest import running_server

  task = TaskSpec("t", "guess_number", {"secret": 3, "max_turns": 1})
  config = AgentConfig(max_turns=1, max_new_tokens=4)
  with running_server(random_params, TOK, version=4) as (srv, _):
    for _ in range(2):  # the dead attempt's turns, left on the server
      r = httpx.post(f"{srv.url}/v1/chat/completions", headers={"X-Session-Id": "g7-0-r0"},
                     json={"model": "policy", "max_tokens": 4,
                           "messages": [{"role": "user", "content": "stale"}]})
      assert r.status_code == 200
    ep = asyncio.run(run_blackbox(make("guess_number"), task, srv.url, config,
                                  session_id="g7-0-r0", group_id="g", tokenizer=TOK))
  assert not ep.infra_error, ep.reason
  assert ep.turns == 1 and len(ep.segments) == 1
  assert "stale" not in TOK.decode(ep.segments[0].tokens.tolist())

  # Session ids hold task ids (eval's `eval-<task id>-<j>`): any character reaches the
  # record, and a `..` in one never reaches another session's (red team).
  with running_server(random_params, TOK, version=4) as (srv, _):
    other = httpx.post(f"{srv.url}/generate", json={"input_ids": [1, 2], "max_new_tokens": 2},
                       headers={"X-Session-Id": "eval-b-0"})
    assert other.status_code == 200
    for sid in ("eval-caf\u00e9-0", "eval-a/../eval-b-0", "eval-dir/./x-0"):
      ep = asyncio.run(run_blackbox(make("guess_number"), task, srv.url, config,
                                    session_id=sid, group_id="g", tokenizer=TOK))
      assert not ep.infra_error and ep.turns == 1 and ep.segments[0].session_id == sid, \
          (sid, ep.reason)
    assert httpx.get(f"{srv.url}/sessions/eval-b-0").status_code == 200


def test_a_parsed_calls_arguments_are_handed_out_as_the_model_wrote_them():
  """A gateway's reply carries each call's arguments as the text sampled: json.dumps
  wrote "café" as "caf\\u00e9" and 1e5 as 100000.0, and the agent that sent the call back
  put other tokens in the next prompt than the model's (red team 24)."""
  import json

  from jaxagent.toolcalls import parse_tool_calls

  text = ('<tool_call> {"arguments" :{"q": "café ☕", "n": 1e5} , "name": "f"}</tool_call>'
          '<tool_call>{"name": "g", "arguments": "{\\"a\\": 1}"}</tool_call>'
          '<tool_call>{"name": "h", "arguments": {}, "arguments": {"x": "}"}}</tool_call>')
  parsed = parse_tool_calls(text)
  assert not parsed.errors
  written = [c.openai()["function"]["arguments"] for c in parsed.calls]
  assert written == ['{"q": "café ☕", "n": 1e5}', '{"a": 1}', '{"x": "}"}']
  assert [json.loads(w) for w in written] == [c.arguments for c in parsed.calls]


def test_a_black_box_replys_tool_call_text_keeps_an_argument_that_writes_its_close_tag():
  """A black-box agent hands each reply to its environment as text in the template's
  tool-call format: an argument holding "</tool_call>" (the model wrote it escaped, the
  gateway parsed one call) must come back as that one call, not two malformed ones."""
  import json

  from envs.tools import parse_tool_calls
  from jaxagent.toolcalls import call_text as _tool_call_text

  content = 'print("</tool_call><tool_call>")'
  text = _tool_call_text("write_file", json.dumps({"path": "a.py", "content": content}))
  parsed = parse_tool_calls(text)
  assert not parsed.errors and len(parsed.calls) == 1
  assert parsed.calls[0].arguments == {"path": "a.py", "content": content}


def test_a_black_box_agent_hands_its_environment_a_malformed_tool_call_as_written():
  """A reply with a well-formed call and a malformed one: the gateway's message keeps
  the malformed one in its content, so the environment a black-box agent hands it to
  answers and counts it as for a white-box agent (red team 13: the gateway dropped it,
  and the environment scored a repaired action)."""
  import types

  from envs.base import TaskSpec
  from envs.calculator import Calculator
  from jaxagent.blackbox import _action_text
  from rollout_server.chat import ChatTurn
  from rollout_server.sessions import SessionStore

  tok = Tokenizer.byte_level()
  sampled = ('Let me add. <tool_call>{"name": "calculate", "arguments": {"expression": '
             '"2+3"}}</tool_call><tool_call>{"name": "calculate", "arguments": '
             '{"expression": </tool_call>')
  req = types.SimpleNamespace(done=True, finish_reason="stop", error=None,
                              output_ids=tok.encode(sampled) + [tok._id("<|im_end|>")],
                              request_id="r1")
  message = ChatTurn(req, tok, None, messages=[], tools=None, sessions=SessionStore(10),
                     session_id=None, kind="chat", id_prefix="call").finish()
  assert len(message["tool_calls"]) == 1
  assert message["content"] == ('Let me add. <tool_call>{"name": "calculate", "arguments": '
                                '{"expression": </tool_call>')

  async def environment_answers(text):
    env = Calculator()
    await env.reset(TaskSpec("c/0", "calculator", {"expression": "2+3"}))
    step = await env.step(text)
    return sorted(m["content"][:24] for m in step.observation.messages), env.counters

  white, black = (asyncio.run(environment_answers(t))
                  for t in (sampled, _action_text(message)))
  assert black == white and white[1]["invalid_tool_calls"] == 1, (white, black)


def test_a_call_whose_taking_out_would_make_another_is_handed_out_as_written():
  """Taking a call out of a reply joins the text either side: `<tool_` + a call + `call>`
  opened a block the policy never wrote, which a black-box agent's environment ran first
  while the record said no such call was made; a white-box agent's ran the one call (a
  red team). Such a reply is handed out as sampled, and both run the same calls."""
  import types

  from envs.tools import parse_tool_calls
  from jaxagent.blackbox import _action_text
  from rollout_server.chat import ChatTurn
  from rollout_server.sessions import SessionStore

  tok = Tokenizer.byte_level()
  for sampled in ('<tool_<tool_call>{"name": "a", "arguments": {}}</tool_call>call>'
                  '{"name": "submit", "arguments": {"x": 1}}</tool_call>',
                  'x <tool_call>{"name": "a", "arguments": {}}</tool_call> y'):
    req = types.SimpleNamespace(done=True, finish_reason="stop", error=None,
                                output_ids=tok.encode(sampled) + [tok._id("<|im_end|>")],
                                request_id="r1")
    message = ChatTurn(req, tok, None, messages=[], tools=None, sessions=SessionStore(10),
                       session_id=None, kind="chat", id_prefix="call").finish()
    white, black = (parse_tool_calls(t) for t in (sampled, _action_text(message)))
    assert [(c.name, c.arguments) for c in black.calls] == \
        [(c.name, c.arguments) for c in white.calls] == [("a", {})], message
    joined = "submit" in sampled
    assert ("tool_calls" not in message) == joined and \
        (message["content"] == sampled) == joined, message


def test_a_call_before_a_block_cut_open_reaches_the_environment():
  """A reviewer: a reply of a good call, then a block the token budget cut open, was
  handed on as its content (the open block) with the call after it, inside the block:
  the environment ran no call, while the gateway and the record said one was made. The
  call goes before the open block, where the model wrote it."""
  from envs.tools import parse_tool_calls
  from jaxagent.blackbox import reply_text

  message = {"role": "assistant", "content": 'Let me see. <tool_call>{"name": "b", "argu',
             "tool_calls": [{"id": "c_0", "type": "function",
                             "function": {"name": "a", "arguments": '{"x": 1}'}}]}
  text = reply_text(message)
  assert text.startswith("Let me see. ")
  parsed = parse_tool_calls(text)
  assert [(c.name, c.arguments) for c in parsed.calls] == [("a", {"x": 1})]
  assert len(parsed.errors) == 1  # (the cut block, as the model left it)
  # (an open block's body may spell another opening: the block is the parser's)
  inner = dict(message, content='<tool_call>{"name": "b", "arguments": {"s": "<tool_call>')
  assert [c.name for c in parse_tool_calls(reply_text(inner)).calls] == ["a"]


def test_a_harness_of_your_own_is_named_by_module_and_function():
  """`agent.kind: module:function` (a module on the path or a .py file) plays episodes
  with a harness of a user's own; a kind that names none is a config error naming why."""
  from jaxagent import config as config_lib
  from jaxagent.blackbox import blackbox_agent, is_blackbox
  from tests.conftest import REPO
  from jaxagent.run_checks import check_config

  harness = blackbox_agent("examples/own_agent.py:run_agent")
  assert harness.__name__ == "run_agent" and is_blackbox("examples/own_agent.py:run_agent")
  assert blackbox_agent("jaxagent.blackbox:run_openai_agent") is not None
  base = config_lib.load(config_lib.RunConfig, os.path.join(REPO, "configs/tiny.yaml"), [])
  for kind, why in [("nope.nothing:run", "no module named 'nope'"),
                    ("examples/none.py:run", "no such file"),
                    ("examples/own_agent.py:missing", "has no async function 'missing'"),
                    ("jaxagent.blackbox:is_blackbox", "has no async function 'is_blackbox'"),
                    (":run", "neither whitebox"), ("opnai", "agent.kind: unknown 'opnai'")]:
    cfg = dataclasses.replace(base, agent=dataclasses.replace(base.agent, kind=kind))
    with pytest.raises(config_lib.ConfigError, match=why.replace("(", r"\(")):
      check_config(cfg)


def test_a_harness_that_misuses_the_gateway_is_named_not_blamed_on_the_servers(
    random_params, monkeypatch, capsys):
  """A new user's harness mistakes were drops of kind `server`, and a run stopped by them
  said "check the rollout servers": a request the gateway refuses (n=2) is
  `gateway_refused` with the gateway's answer, calls without the session header
  `no_turns_recorded`, a harness stuck in its own code `agent_stuck`."""
  import httpx

  from jaxagent import blackbox as blackbox_mod
  from tests.rollout_server.conftest import running_server

  async def two_at_once(env, task, base_url, *, session_id, **kw):
    await env.reset(task)
    async with httpx.AsyncClient(headers={"X-Session-Id": session_id}) as c:
      r = await c.post(f"{base_url}/v1/chat/completions", json={
          "model": "policy", "n": 2, "max_tokens": 2,
          "messages": [{"role": "user", "content": "hi"}]})
      r.raise_for_status()
    return []

  async def no_header(env, task, base_url, *, session_id, **kw):
    obs = await env.reset(task)
    async with httpx.AsyncClient() as c:
      r = await c.post(f"{base_url}/v1/chat/completions", json={
          "model": "policy", "max_tokens": 2, "messages": obs.messages})
      r.raise_for_status()
    await env.step(r.json()["choices"][0]["message"]["content"] or "")
    return []

  async def stuck(env, task, base_url, *, session_id, **kw):
    await env.reset(task)
    await asyncio.sleep(600)

  task = TaskSpec("t", "guess_number", {"secret": 3, "max_turns": 1})
  config = AgentConfig(max_turns=1, max_new_tokens=2, episode_deadline_s=120)
  got = {}
  with running_server(random_params, TOK, version=4) as (srv, _):
    for name, harness, deadline_s in (("n2", two_at_once, 120), ("header", no_header, 120),
                                      ("stuck", stuck, 1.5)):
      monkeypatch.setitem(blackbox_mod.BLACKBOX_AGENTS, "openai", harness)
      got[name] = asyncio.run(run_blackbox(
          make("guess_number"), task, srv.url,
          dataclasses.replace(config, episode_deadline_s=deadline_s),
          session_id=f"s-{name}", group_id="g"))
  ep = got["n2"]
  assert ep.infra_error and ep.infra_kind == "gateway_refused", (ep.infra_kind, ep.reason)
  assert "400" in ep.reason and "n must be 1" in ep.reason, ep.reason
  ep = got["header"]
  assert ep.infra_error and ep.infra_kind == "no_turns_recorded", (ep.infra_kind, ep.reason)
  assert "stepped its environment 1 times" in ep.reason and "X-Session-Id" in ep.reason
  ep = got["stuck"]
  assert ep.infra_error and ep.infra_kind == "agent_stuck", (ep.infra_kind, ep.reason)
  assert "no request on the gateway and no environment call" in ep.reason


def test_a_reply_s_tool_calls_reach_the_environment_and_one_handed_without_them_is_said(
    capsys):
  """The repository's own example harness handed `env.step` a reply's content alone: the
  gateway returns a call it parsed in `tool_calls`, so the environment never saw one
  (every call trained as a failure, without a word; a new user). `reply_text` hands on
  both; a harness that drops them is warned once."""
  from jaxagent import blackbox as blackbox_mod
  from jaxagent.blackbox import reply_text
  from jaxagent.trajectory import TurnRecord

  call = {"id": "c0", "type": "function",
          "function": {"name": "calculate", "arguments": '{"expression": "1+2"}'}}
  message = {"role": "assistant", "content": "", "tool_calls": [call]}
  assert reply_text(message) == ('<tool_call>{"name": "calculate", "arguments": '
                                 '{"expression": "1+2"}}</tool_call>')
  assert reply_text({"role": "assistant", "content": "3"}) == "3"
  with open(os.path.join(os.path.dirname(__file__), "..", "examples", "own_agent.py")) as f:
    assert "reply_text(r.json()" in f.read()  # (the example hands both)

  record = TurnRecord([1], [2], [-0.1], [0], "stop")
  record.response = message
  blackbox_mod._SAID.discard("tool_calls_dropped")
  blackbox_mod._step_numbers([record], set(), [reply_text(message)])  # handed whole
  assert capsys.readouterr().err == ""
  for _ in range(2):
    blackbox_mod._step_numbers([record], set(), [""])  # its content alone
  err = capsys.readouterr().err
  assert err.count("warning: the black-box agent handed its environment a reply's "
                   "content without its tool calls") == 1, err
  assert "jaxagent.blackbox.reply_text(message)" in err


def test_turns_past_the_budget_a_harness_is_given_are_said_once(capsys):
  """A harness asking for more than `max_tokens=agent.max_new_tokens` trained replies of
  160 tokens in a run set to 1, without a word (a new user)."""
  from jaxagent import blackbox as blackbox_mod

  blackbox_mod._SAID.discard("long_turns")
  cfg = AgentConfig(max_new_tokens=4)
  blackbox_mod._say_long_turns([{"output_ids": [1, 2, 3, 4]}], cfg)
  assert capsys.readouterr().err == ""
  for _ in range(2):
    blackbox_mod._say_long_turns([{"output_ids": [1] * 9}], cfg)
  err = capsys.readouterr().err
  assert err.count("warning: the black-box agent's turns run past agent.max_new_tokens "
                   "(4; one of 9 tokens)") == 1, err


def test_a_harness_chatting_on_after_its_environment_ended_is_graded_as_it_played(
    random_params, monkeypatch):
  """A harness that called the gateway again after the step that ended its environment
  had those turns trained (text the environment never saw), and one whose further chat
  outgrew the context made a solved episode a truncation, a fail. The episode is its
  play: graded, its turns through that step trained; stepping the environment past its
  end is the harness's error, named."""
  import openai

  from jaxagent import blackbox as blackbox_mod
  from tests.rollout_server.conftest import running_server

  async def chatty(env, task, base_url, *, session_id, step_again=False, **kw):
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused",
                                default_headers={"X-Session-Id": session_id})
    try:
      messages = list((await env.reset(task)).messages)
      await client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
      step = await env.step("3")  # (the secret: solved in one step)
      assert step.terminated
      for words in (1, 1, 3000):  # (on and on, at last past the context)
        messages.append({"role": "user", "content": "thanks! " + "x " * words})
        await client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
      return [step.reward]
    finally:
      await client.close()

  async def steps_again(env, task, base_url, **kw):
    await env.reset(task)
    await env.step("3")
    await env.step("3")

  async def turn_cut(env, task, base_url, *, session_id, **kw):  # (a built-in harness's
    # turn past its deadline: gateway_turn's InfraError, met after the end)
    from jaxagent.errors import InfraError

    await chatty(env, task, base_url, session_id=session_id)
    raise InfraError("turn_deadline", "the turn ran past agent.turn_deadline_s")

  task = TaskSpec("t", "guess_number", {"secret": 3, "max_turns": 3})
  cfg = AgentConfig(max_turns=3, max_new_tokens=2)
  blackbox_mod._SAID.discard("past_the_end")
  with running_server(random_params, TOK, version=2) as (srv, _):
    monkeypatch.setitem(blackbox_mod.BLACKBOX_AGENTS, "openai", chatty)
    ep = asyncio.run(run_blackbox(make("guess_number"), task, srv.url, cfg,
                                  session_id="s-chatty", group_id="g"))
    monkeypatch.setitem(blackbox_mod.BLACKBOX_AGENTS, "openai", turn_cut)
    cut = asyncio.run(run_blackbox(make("guess_number"), task, srv.url, cfg,
                                   session_id="s-cut", group_id="g"))
    monkeypatch.setitem(blackbox_mod.BLACKBOX_AGENTS, "openai", steps_again)
    with pytest.raises(RuntimeError, match="stepped its environment after its episode ended"):
      asyncio.run(run_blackbox(make("guess_number"), task, srv.url, cfg,
                               session_id="s-again", group_id="g"))
  assert not ep.infra_error and ep.status == "completed", (ep.status, ep.reason)
  assert ep.verdict["status"] == "pass" and ep.turns == 1, (ep.verdict, ep.turns)
  (seg,) = ep.segments
  assert seg.num_action_tokens <= 2  # (the first call's reply only)
  assert not cut.infra_error and cut.verdict["status"] == "pass", (cut.status, cut.reason)


def test_play_past_the_end_is_cut_only_where_the_replies_were_handed_as_they_came():
  """Which calls came after the end is the count of turns the gateway held as the
  environment ended; where that is not known, the replies handed tell, and where the
  actions are not the replies (a harness that rewrote them) nothing is cut: a harness's
  side calls counted as steps cut the reply that ended the episode (a reviewer)."""
  from jaxagent.blackbox import _played

  def turn(prompt, reply):
    return {"prompt_ids": prompt, "output_ids": [7], "output_logprobs": [-0.1],
            "versions": [0], "finish_reason": "stop",
            "response": {"role": "assistant", "content": reply}}

  turns = [turn([1], "A1"), turn([1, 7, 2], "title1"), turn([1, 7, 3], "A2"),
           turn([1, 7, 3, 7, 4], "title2"), turn([1, 7, 3, 7, 5], "A3")]
  assert _played(turns, ["a1", "a2", "a3"]) == turns  # (rewritten: every turn kept)
  cut = _played(turns + [turn([1, 7, 3, 7, 5, 7, 6], "chat")], ["A1", "A2", "A3"])
  assert [t["response"]["content"] for t in cut] == ["A1", "title1", "A2", "title2", "A3"]
  chat = turns + [turn([1, 7, 3, 7, 5, 7, 6], "chat"), turn([1, 7, 3, 7, 5], "A3 again")]
  assert _played(chat, ["a1", "a2", "a3"], at_end=5) == turns + chat[-1:]  # (a sibling)


def test_a_record_whose_values_are_of_another_type_is_no_record():
  """A gateway's turn whose log-probs came as text, or whose token ids as booleans (JSON's
  true), is a damaged record, the infrastructure's: read on, a text log-prob stopped the
  run at the batch, and `true` trained as token 1."""
  from jaxagent.blackbox import _check_turns
  from jaxagent.errors import InfraError

  good = {"prompt_ids": [1, 2], "output_ids": [3], "output_logprobs": [-0.5],
          "versions": [1], "finish_reason": "stop"}
  _check_turns([good, dict(good, output_logprobs=[0])], "s")  # (an int log-prob is one)
  for damage in ({"output_logprobs": ["-0.5"]}, {"output_ids": [True]},
                 {"prompt_ids": [1, 2.0]}):
    with pytest.raises(InfraError, match="turn 1 is no turn"):
      _check_turns([good, dict(good, **damage)], "s")


def test_every_turn_of_a_black_box_session_is_sampled_as_the_run_trains():
  """A harness that samples its first turn as the run trains and its later ones its own
  way (hotter, a top_k of its own, or without saying) trains on another distribution's
  log-probs as surely as one that never did: every turn is checked, both ways."""
  from jaxagent.blackbox import SamplingMismatch, check_sampling

  cfg = AgentConfig(temperature=0.8, top_p=0.9, top_k=50)
  ok = {"sampling": {"temperature": 0.8, "top_p": 0.9, "top_k": 50}}
  check_sampling([ok, ok], cfg, "s")
  for other in ({"temperature": 1.5}, {"temperature": 0.0}, {"top_k": 0}, {"top_p": 1.0},
                {"top_k": None}):
    turn = {"sampling": {**ok["sampling"], **other}}
    with pytest.raises(SamplingMismatch, match="turn 1 of black-box session s"):
      check_sampling([ok, turn], cfg, "s")
  with pytest.raises(SamplingMismatch, match="turn 1 "):
    check_sampling([ok, {}], cfg, "s")


def test_play_past_the_end_after_a_last_best_of_two_and_a_side_call_before_the_end():
  """Where the gateway did not say how many turns it held as the environment ended, a
  last step sampled twice still tells the end (the reply acted on): the chat after it is
  cut. Where it did say, a side call between the last reply and the environment's end
  is of the play: kept, not cut as if it came after."""
  from jaxagent.blackbox import _played

  def turn(prompt, reply):
    return {"prompt_ids": prompt, "output_ids": [7], "output_logprobs": [-0.1],
            "versions": [0], "finish_reason": "stop",
            "response": {"role": "assistant", "content": reply}}

  best = [turn([1], "A1"), turn([1, 7, 2], "B"), turn([1, 7, 2], "A2")]
  chat = turn([5, 5], "chat")
  assert _played(best + [chat], ["A1", "A2"]) == best
  side = turn([9], "a title")
  assert _played(best + [side], ["A1", "A2"], at_end=4) == best + [side]


def test_a_black_box_sessions_wire_id_is_fresh_each_episode_and_bounded(random_params,
                                                                        monkeypatch):
  """The secret part of a wire id is drawn anew each episode: one derived from the
  session id (a hash of it) is as predictable as the id, and a sibling could write into
  it again. An id too long for a header goes as its hash, the secret after it, and one
  with a control character (a task id's) quoted: raw, no header could carry it."""
  from jaxagent import blackbox as blackbox_mod
  from tests.rollout_server.conftest import running_server

  honest, ids = blackbox_mod.BLACKBOX_AGENTS["openai"], []

  async def noting(env, task, base_url, *, session_id, **kw):
    ids.append(session_id)
    return await honest(env, task, base_url, session_id=session_id, **kw)

  monkeypatch.setitem(blackbox_mod.BLACKBOX_AGENTS, "openai", noting)
  task = TaskSpec("t", "guess_number", {"secret": 3, "max_turns": 1})
  config = AgentConfig(max_turns=1, max_new_tokens=2)
  long_id = "eval-" + "x" * 600 + "-0"
  with running_server(random_params, TOK, version=4) as (srv, _):
    eps = [asyncio.run(run_blackbox(make("guess_number"), task, srv.url, config,
                                    session_id=sid, group_id="g"))
           for sid in ("g0-0-r0", "g0-0-r0", long_id, "eval-a\x01b-0")]
  assert all(not ep.infra_error for ep in eps), [ep.reason for ep in eps]
  assert eps[2].session_id == long_id
  first, again, long_wire, quoted = ids
  assert first.startswith("g0-0-r0~") and again.startswith("g0-0-r0~") and first != again
  assert long_wire.startswith("sha256-") and len(long_wire) == len("sha256-") + 32 + 25
  assert quoted.startswith("eval-a%01b-0~")


def test_a_black_box_episode_deletes_the_record_it_took_on_a_guarded_server(random_params,
                                                                           monkeypatch):
  """The record of a session is taken and deleted with the control token: a record left
  behind filled the server's session store until its bounds dropped live sessions' records
  (their episodes lost as `session_evicted`). The record looked for is the wire id's (the
  session id alone, without its secret, is never recorded)."""
  import httpx

  from jaxagent import blackbox as blackbox_mod
  from tests.rollout_server.conftest import running_server

  honest, ids = blackbox_mod.BLACKBOX_AGENTS["openai"], []

  async def noting(env, task, base_url, *, session_id, **kw):
    ids.append(session_id)
    return await honest(env, task, base_url, session_id=session_id, **kw)

  monkeypatch.setitem(blackbox_mod.BLACKBOX_AGENTS, "openai", noting)
  token = "run-token-" + "y" * 30
  task = TaskSpec("t", "guess_number", {"secret": 3, "max_turns": 1})
  with running_server(random_params, TOK, control_token=token) as (srv, _):
    ep = asyncio.run(run_blackbox(make("guess_number"), task, srv.url,
                                  AgentConfig(max_turns=1, max_new_tokens=2),
                                  session_id="bb-del", control_token=token))
    (wire,) = ids
    left = httpx.get(f"{srv.url}/sessions/{wire}").status_code
  assert not ep.infra_error and ep.segments, ep.reason
  assert left == 404


def test_a_record_that_says_its_first_turns_were_dropped_is_not_the_whole_episode():
  """A first turn whose `lost_before` says the server dropped the session's earlier turns,
  in any form it says so, drops the episode as the infrastructure's; only a first turn
  that says nothing (or an empty note) is the whole episode."""
  from jaxagent.blackbox import _check_whole
  from jaxagent.errors import InfraError

  for said in ({}, None, 0):
    _check_whole([{"lost_before": said}, {"lost_before": True}], "s")
  for said in (True, {"turns": 2, "reason": "ttl"}, 1):
    with pytest.raises(InfraError, match="dropped session 's'"):
      _check_whole([{"lost_before": said}], "s")


def test_a_black_box_episodes_outcome_is_trained_on_its_last_turn_and_its_cap_said(
    random_params, monkeypatch):
  """The verdict's reward is added to a black-box episode's last turn, as the white-box
  agent's (left off, a solved episode trained as its process rewards alone); one that
  used every turn it had and failed is a truncation (here the environment's own budget,
  `turn_budget`, as the white-box agent reads it), and one solved on its last turn is
  completed, not a truncation."""
  import openai

  from jaxagent import blackbox as blackbox_mod
  from tests.rollout_server.conftest import running_server

  earned = []

  def guessing(guesses):
    async def harness(env, task, base_url, *, session_id, max_tokens, temperature, top_p,
                      top_k, **_):
      client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused",
                                  max_retries=0, default_headers={"X-Session-Id": session_id})
      obs, rewards = await env.reset(task), []
      for guess in guesses:
        await client.chat.completions.create(
            model="policy", messages=obs.messages, max_tokens=max_tokens,
            temperature=temperature, top_p=top_p, extra_body={"top_k": top_k})
        rewards.append((await env.step(guess)).reward)
      await client.close()
      earned.append(rewards)
      return rewards
    return harness

  task = TaskSpec("t", "guess_number", {"secret": 3, "max_turns": 2})
  cfg = AgentConfig(max_turns=2, max_new_tokens=2)
  eps = []
  with running_server(random_params, TOK, version=4) as (srv, _):
    for guesses in (["1", "3"], ["1", "2"]):
      monkeypatch.setitem(blackbox_mod.BLACKBOX_AGENTS, "openai", guessing(guesses))
      eps.append(asyncio.run(run_blackbox(make("guess_number"), task, srv.url, cfg,
                                          session_id="bb-" + "".join(guesses), group_id="g")))
  solved, failed = eps
  assert (solved.status, solved.verdict["status"]) == ("completed", "pass"), solved.reason
  assert solved.verdict["reward"] > 0 and solved.turns == 2
  assert solved.turn_rewards == [earned[0][0], earned[0][1] + solved.verdict["reward"]]
  assert (failed.status, failed.reason) == ("truncated", "turn_budget"), failed.reason
  assert not failed.infra_error and failed.turns == 2


def test_a_request_the_gateway_refuses_through_a_client_is_not_the_policys_truncation(
    random_params, monkeypatch):
  """Only a refusal that says the prompt is too long is the policy's length (a scored
  truncation); any other 400 the client raises (a request the harness got wrong) is the
  harness's, `gateway_refused`: read as the policy's, its episodes trained as failures."""
  import httpx
  import openai

  from jaxagent import blackbox as blackbox_mod
  from tests.rollout_server.conftest import running_server

  async def refused(env, task, base_url, **_):
    await env.reset(task)
    await env.step("1")
    request = httpx.Request("POST", f"{base_url}/v1/chat/completions")
    body = {"error": {"message": "n must be 1"}}
    raise openai.BadRequestError("n must be 1", body=body,
                                 response=httpx.Response(400, request=request, json=body))

  monkeypatch.setitem(blackbox_mod.BLACKBOX_AGENTS, "openai", refused)
  task = TaskSpec("t", "guess_number", {**UNGUESSABLE, "max_turns": 3})
  with running_server(random_params, TOK, version=4) as (srv, _):
    ep = asyncio.run(run_blackbox(make("guess_number"), task, srv.url,
                                  AgentConfig(max_turns=3, max_new_tokens=2),
                                  session_id="bb-refused", group_id="g"))
  assert ep.infra_error and ep.infra_kind == "gateway_refused", (ep.status, ep.reason)
  assert "400" in ep.reason and "n must be 1" in ep.reason
