"""Black-box agents: any program that speaks the OpenAI chat API, OpenAI's Responses API
or Anthropic's Messages API plays an episode against the rollout server's gateway with an
`X-Session-Id` (`run_openai_agent`, `run_responses_agent`, `run_anthropic_agent`, or a
harness of your own named `module:function`), and `run_blackbox` rebuilds its token-exact
trajectory from the turns the server recorded (`collect_session`). The white-box loop,
and the `Episode` both produce, are `jaxagent.agent`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import inspect
import json
import secrets
import sys
import time
from typing import Any, Awaitable, Callable, Optional
from urllib.parse import quote

from envs.base import import_entry, trained_rewards
from envs import waits
from jaxagent import agent as agent_lib, control
from jaxagent.agent import (EPISODE_WALL_FACTOR, FIRST_PROMPT_TOO_LONG, Episode, MeasuredEnv,
                            graded, judge_cut, provenance, stamp, while_it_moves)
from jaxagent.config import AgentConfig
from jaxagent.errors import PROMPT_TOO_LONG, InfraError
from jaxagent.tls import shared_tls
from jaxagent.tokenizer import Tokenizer
from jaxagent.toolcalls import parse_tool_calls, with_calls
from jaxagent.trajectory import Segment, TrajectoryManager, TurnRecord, reported_seconds


async def gateway_progress(base_url: str, session_id: str) -> Optional[dict]:
  """How the session's turns in flight on a rollout server or router stand (`GET
  /requests?session_id=`: requests, prefilled, output_tokens, decode_s); None when
  the gateway does not say."""
  import httpx

  try:
    async with httpx.AsyncClient(timeout=10, verify=shared_tls()) as client:
      r = await client.get(f"{base_url}/requests", params={"session_id": session_id})
    got = r.json() if r.status_code == 200 else None
  except (httpx.HTTPError, ValueError):
    return None
  return got if isinstance(got, dict) else None


async def gateway_turn(call: Awaitable, base_url: str, session_id: str, deadline_s: float):
  """A black-box agent's call to the gateway, bounded as the built-in agent's turns are
  (`_within_turn_deadline`): each `deadline_s` without its answer, the gateway is asked
  how the session's turns in flight stand; one that did not move since the last look
  (none in flight, still queued, stalled) raises InfraError("turn_deadline"), one whose
  tokens keep coming is waited on (its length is the policy's). The built-in harnesses
  use it; an agent of your own may too, or bound its calls as it likes."""
  async def progress():
    now = await gateway_progress(base_url, session_id)
    if not now or not now.get("requests"):
      return None, "none in flight"
    if now.get("queued") == now.get("requests"):
      return None, "still queued"
    return (now.get("prefilled"), now.get("output_tokens")), "stalled"

  return await while_it_moves(call, progress, deadline_s, "the gateway")


def _openai_client(base_url: str, session_id: str):
  """The `openai` client a built-in black-box agent speaks with: the gateway's session
  header, no retries (a failed turn is the episode's infrastructure error, re-rolled), no
  timeout (`gateway_turn` bounds each turn by whether it moves)."""
  import openai

  return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                            timeout=None, default_headers={"X-Session-Id": session_id})


def turn_seed(session_id: str, turn: int) -> int:
  """A harness's sampling seed for its `turn`: the built-in agent's for the episode's
  session, whose id the harness is handed with a secret part (`~...`, new each play)
  that is left out, so that an episode played again samples again the same (an
  evaluation is reproducible; a harness sending no seed has the gateway draw one)."""
  return agent_lib.turn_seed(session_id.rsplit("~", 1)[0], turn)


async def run_openai_agent(env, task, base_url: str, *, session_id: str, model: str = "policy",
                           max_turns: int = 8, max_tokens: int = 32, temperature: float = 1.0,
                           top_p: float = 1.0, top_k: int = 0,
                           turn_timeout_s: float = 600.0) -> list[float]:
  """An agent written only against the official `openai` client (it knows nothing of
  token ids): chat with the gateway, hand each reply to the environment.

  Returns the per-turn rewards; the trajectory is read back from the server.
  """
  client = _openai_client(base_url, session_id)
  rewards: list[float] = []
  try:
    obs = await env.reset(task)
    messages = list(obs.messages)
    for turn in range(max_turns):
      kwargs = {"tools": obs.tools} if obs.tools else {}
      # (seeded as the built-in agent's turns are: an evaluation is reproducible; the
      # gateway drew a seed of its own for a request without one)
      resp = await gateway_turn(client.chat.completions.create(
          model=model, messages=messages, max_tokens=max_tokens, temperature=temperature,
          top_p=top_p, seed=turn_seed(session_id, turn), extra_body={"top_k": top_k},
          **kwargs), base_url, session_id, turn_timeout_s)
      msg = resp.choices[0].message
      # hand the raw call text back in the template's format
      text = with_calls(msg.content or "", [(c.function.name, c.function.arguments)
                                            for c in msg.tool_calls or []])
      messages.append({"role": "assistant", "content": text})
      step = await env.step(text)
      rewards.append(float(step.reward))
      messages += step.observation.messages
      if step.terminated or step.truncated:
        break
  finally:
    await client.close()
  return rewards


def anthropic_messages(messages: list[dict], tool_use_ids: tuple[str, ...] = ()
                       ) -> tuple[str, list[dict]]:
  """An environment's messages (OpenAI's shape) in Anthropic's: (system text, messages).
  Tool calls become `tool_use` blocks, tool messages `tool_result` blocks of a user
  message (the k-th answering `tool_use_ids[k]`, the ids of the reply they answer, or the
  call of an assistant message among `messages` whose id it names; others text blocks),
  consecutive messages of one role one message."""
  system, out = "", []
  answers, called = iter(tool_use_ids), set()
  for m in messages:
    role, content = m["role"], m.get("content") or ""
    if role == "system":
      system += content
      continue
    if role == "assistant":
      blocks = [{"type": "text", "text": content}] if content else []
      blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                  "input": json.loads(c["function"]["arguments"])}
                 for c in m.get("tool_calls") or []]
      called = {c["id"] for c in m.get("tool_calls") or []}
    elif role == "tool":
      # One without a call id (the error for a malformed call, which the reply's blocks
      # do not hold) answers no tool use: text, taking no id (a tool_result of an id the
      # reply did not call is refused, 400, and the episode ended as the server's
      # failure, re-rolled; taking the next id, it answered a valid call with the error).
      use_id = None
      if m.get("tool_call_id"):
        use_id = m["tool_call_id"] if m["tool_call_id"] in called else next(answers, None)
      role = "user"
      blocks = ([{"type": "text", "text": content}] if use_id is None else
                [{"type": "tool_result", "content": content, "tool_use_id": use_id}])
    else:
      blocks = [{"type": "text", "text": content}]
    if out and out[-1]["role"] == role:
      out[-1]["content"] += blocks
    else:
      out.append({"role": role, "content": blocks})
  for m in out:  # a user message's tool results come before its text (Anthropic's rule)
    if m["role"] == "user":
      m["content"].sort(key=lambda b: b["type"] != "tool_result")
  return system, out


async def run_anthropic_agent(env, task, base_url: str, *, session_id: str,
                              model: str = "policy", max_turns: int = 8, max_tokens: int = 32,
                              temperature: float = 1.0, top_p: float = 1.0,
                              top_k: int = 0, turn_timeout_s: float = 600.0) -> list[float]:
  """An agent written only against the official `anthropic` client: Anthropic's messages,
  its replies' content blocks sent back as they came, `tool_use` answered by
  `tool_result`. Each reply goes to the environment as text (its tool uses in the
  template's tool-call format). The sampling goes as extra body fields (recent clients
  have no argument for the temperature).

  Returns the per-turn rewards; the trajectory is read back from the server.
  """
  import anthropic

  client = anthropic.AsyncAnthropic(base_url=base_url, api_key="unused", max_retries=0,
                                    timeout=None, default_headers={"X-Session-Id": session_id})
  rewards: list[float] = []
  try:
    obs = await env.reset(task)
    system, messages = anthropic_messages(obs.messages)
    kwargs: dict[str, Any] = {"system": system} if system else {}
    if obs.tools:  # function schemas as Anthropic's tools (the server renders them back)
      kwargs["tools"] = [{**{k: v for k, v in t["function"].items() if k != "parameters"},
                          "input_schema": t["function"]["parameters"]} for t in obs.tools]
    for turn in range(max_turns):
      resp = await gateway_turn(client.messages.create(
          model=model, messages=messages, max_tokens=max_tokens,
          extra_body={"temperature": temperature, "top_p": top_p, "top_k": top_k,
                      "seed": turn_seed(session_id, turn)},
          **kwargs), base_url, session_id, turn_timeout_s)
      uses = [b for b in resp.content if b.type == "tool_use"]
      text = with_calls("".join(b.text for b in resp.content if b.type == "text"),
                        [(b.name, json.dumps(b.input)) for b in uses])
      messages.append({"role": "assistant", "content": resp.content})
      step = await env.step(text)
      rewards.append(float(step.reward))
      messages += anthropic_messages(step.observation.messages, tuple(b.id for b in uses))[1]
      if step.terminated or step.truncated:
        break
  finally:
    await client.close()
  return rewards


def response_items(messages: list[dict], call_ids: tuple[str, ...] = (), *,
                   first: bool = True) -> tuple[str, list[dict]]:
  """An environment's messages (OpenAI's chat shape) as the Responses API's input:
  (instructions: the leading system messages of the `first` ones, items). An assistant
  message becomes a `message` item and a
  `function_call` item a call; a tool message a `function_call_output` (the k-th
  answering `call_ids[k]`, the calls of the reply they answer, or the call of an
  assistant message among `messages` whose id it names), or, answering no call (the
  error for a malformed call), a user message."""
  instructions, items = "", []
  answers, called = iter(call_ids), set()
  for m in messages:
    role, content = m["role"], m.get("content") or ""
    if role == "system" and first and not items:
      instructions += content
    elif role == "assistant":
      if content or not m.get("tool_calls"):
        items.append({"role": "assistant", "content": content})
      items += [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                 "arguments": c["function"]["arguments"]} for c in m.get("tool_calls") or []]
      called = {c["id"] for c in m.get("tool_calls") or []}
    elif role == "tool":
      call_id = None
      if m.get("tool_call_id"):
        call_id = m["tool_call_id"] if m["tool_call_id"] in called else next(answers, None)
      items.append({"role": "user", "content": content} if call_id is None else
                   {"type": "function_call_output", "call_id": call_id, "output": content})
    else:
      items.append({"role": role, "content": content})
  return instructions, items


async def run_responses_agent(env, task, base_url: str, *, session_id: str,
                              model: str = "policy", max_turns: int = 8, max_tokens: int = 32,
                              temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                              turn_timeout_s: float = 600.0) -> list[float]:
  """An agent written only against the `openai` client's Responses API (as the
  `openai-agents` SDK is): the input items it keeps itself (`store: false`), each
  response's output items sent back as they came, a `function_call` answered by a
  `function_call_output`. Each reply goes to the environment as text (its calls in the
  template's tool-call format). `top_k` goes as an extra body field.

  Returns the per-turn rewards; the trajectory is read back from the server.
  """
  client = _openai_client(base_url, session_id)
  rewards: list[float] = []
  try:
    obs = await env.reset(task)
    instructions, items = response_items(obs.messages)
    kwargs: dict[str, Any] = {"instructions": instructions} if instructions else {}
    if obs.tools:  # function schemas as the Responses API's tools (rendered back alike)
      kwargs["tools"] = [{"type": "function", **t["function"]} for t in obs.tools]
    for turn in range(max_turns):
      resp = await gateway_turn(client.responses.create(
          model=model, input=items, max_output_tokens=max_tokens, temperature=temperature,
          top_p=top_p, store=False, extra_body={"top_k": top_k,
                                                "seed": turn_seed(session_id, turn)},
          **kwargs), base_url, session_id, turn_timeout_s)
      calls = [o for o in resp.output if o.type == "function_call"]
      text = with_calls("".join(p.text for o in resp.output if o.type == "message"
                                for p in o.content if p.type == "output_text"),
                        [(c.name, c.arguments) for c in calls])
      items += [o.model_dump(exclude_none=True) for o in resp.output]
      step = await env.step(text)
      rewards.append(float(step.reward))
      items += response_items(step.observation.messages, tuple(c.call_id for c in calls),
                              first=False)[1]
      if step.terminated or step.truncated:
        break
  finally:
    await client.close()
  return rewards


# The black-box agents by the API they speak (`agent.kind`).
BLACKBOX_AGENTS = {"openai": run_openai_agent, "anthropic": run_anthropic_agent,
                   "responses": run_responses_agent}
# The client library each speaks with.
BLACKBOX_CLIENTS = {"openai": "openai", "anthropic": "anthropic", "responses": "openai"}


def is_blackbox(kind: str) -> bool:
  """Whether `agent.kind` names a black-box harness: a built-in one, or one of your own
  (`module:function`)."""
  return kind in BLACKBOX_AGENTS or ":" in kind


def blackbox_agent(kind: str) -> Callable[..., Awaitable[list[float]]]:
  """The black-box harness `agent.kind` names: a built-in one (`BLACKBOX_AGENTS`), or
  one of your own as `module:function` (a module name on the path, or a .py file), an
  async function called as the built-in ones
  are (`run_openai_agent`'s signature: the environment, the task, the gateway's URL,
  then `session_id` and the run's sampling and budgets as keywords) that plays the
  episode against the gateway with `X-Session-Id: session_id` and returns the per-step
  rewards (each `env.step` reward, in order; the trajectory is read back from the
  server's record of the session, and the rewards trained are the environment's own, as
  its steps returned them: a harness's list is not read). A harness is code of the
  run's own, trusted as the rest (it runs in the learner's process, holding its
  environment); the policy's code runs in the sandbox. ValueError naming what is
  wrong."""
  if kind in BLACKBOX_AGENTS:
    return BLACKBOX_AGENTS[kind]
  module, _, name = kind.rpartition(":")
  if not module or not name:
    raise ValueError(f"agent.kind: {kind!r} is neither whitebox, one of "
                     f"{', '.join(BLACKBOX_AGENTS)}, nor module:function")
  try:
    found = import_entry(module)
  except ValueError as e:
    raise ValueError(f"agent.kind {kind}: {e}") from None
  harness = getattr(found, name, None)
  if not inspect.iscoroutinefunction(harness):
    raise ValueError(f"agent.kind {kind}: {module} has no async function {name!r} "
                     f"(found {type(harness).__name__})")
  return harness


def _action_text(response: Optional[dict]) -> Optional[str]:
  """The text an agent hands the environment for a gateway reply: its content, then its
  tool calls in the chat template's format (what the built-in agents send)."""
  if not response:
    return None
  return with_calls(response.get("content") or "", [
      (c["function"]["name"], c["function"]["arguments"])
      for c in response.get("tool_calls") or []])


def reply_text(message: dict) -> str:
  """What an agent of your own hands `env.step` for a chat completions reply (`message`:
  `choices[0].message` as a dict): its content, then each of its `tool_calls` in the
  chat template's format, which the environment parses (the gateway moves a call it
  parsed out of the content: handed the content alone, the environment never saw it)."""
  return _action_text(message) or ""


_SAID: set[str] = set()  # the warnings said (each once a process)


def _say_once(kind: str, message: str) -> None:
  if kind not in _SAID:
    _SAID.add(kind)
    print(f"warning: {message} (said once)", file=sys.stderr, flush=True)


def _say_tool_calls_dropped(records: list[TurnRecord], actions: list[str]) -> None:
  """Says, once, that an agent handed its environment a reply's content without the
  tool calls the gateway parsed out of it (every tool call lost, and trained as a
  failure: the repository's own example did so; a new user)."""
  handed = set(actions)
  for r in records:
    response = r.response or {}
    if response.get("tool_calls") and (response.get("content") or "") in handed \
        and _action_text(response) not in handed:
      _say_once("tool_calls_dropped", "the black-box agent handed its environment a reply's "
                "content without its tool calls (the gateway returns a call it parsed in "
                "tool_calls, not in the content): the environment never saw them, and the "
                "episode is trained as it went. Hand env.step "
                "jaxagent.blackbox.reply_text(message)")


def _step_numbers(records: list[TurnRecord], left: set[int],
                  actions: Optional[list[str]]) -> list[int]:
  """Each recorded call's environment step (the server's own `turn` counts its gateway
  calls). With the texts the agent handed the environment (`actions`), in order: a
  call whose reply is the next one handed ends that step, and the calls between (a
  harness's side calls: a title, a summary) are of the step under way: counted as
  steps, they pushed every later step's process reward onto the call before it. When
  the replies do not give the actions so (a harness that hands them otherwise), each
  call the agent kept is a step."""
  kept, step = [], 0
  for i in range(len(records)):
    kept.append(step)
    step += i not in left
  if not actions:
    return kept
  matched = _matched_steps(records, left, actions)
  if matched is None:
    _say_tool_calls_dropped(records, actions)
  return matched if matched is not None else kept


def _matched_steps(records: list[TurnRecord], left: set[int],
                   actions: list[str]) -> Optional[list[int]]:
  """Each call's step where every action handed is a reply, in order (`_step_numbers`);
  None where they are not."""
  out, k = [], 0
  for i, r in enumerate(records):
    out.append(k)
    if i not in left and k < len(actions) and _same_action(actions[k], r.response):
      k += 1
  return out if k == len(actions) else None


def _action_key(text: str) -> tuple:
  """An action as its text and its tool calls' names and argument values (however the
  agent wrote the arguments again: the built-in Anthropic agent hands a tool_use's input
  dumped anew)."""
  parsed = parse_tool_calls(text)
  return parsed.content, parsed.errors, [
      (c.name, json.dumps(c.arguments, sort_keys=True)) for c in parsed.calls]


def _same_action(handed: str, response: Optional[dict]) -> bool:
  """Whether `handed`, what the agent gave the environment, is the reply `response`."""
  made = _action_text(response)
  return made is not None and (made == handed or _action_key(made) == _action_key(handed))


def _acted_on(actions: list[str]) -> Callable[[TurnRecord, list[TurnRecord]], bool]:
  """Whether the agent handed its environment a turn's reply, given the turns it went on
  from (`TrajectoryManager.acted_on`): the reply is one of the actions its turns before
  had not made yet (those made, in order, are theirs). Any action of the episode would
  do, and a best-of-two at the last step whose rejected reply repeated an earlier
  action ("ls" again) trained neither reply (a reviewer)."""
  def acted(record: TurnRecord, before: list[TurnRecord]) -> bool:
    made = 0
    for r in before:
      if made < len(actions) and _same_action(actions[made], r.response):
        made += 1
    return any(_same_action(a, record.response) for a in actions[made:])
  return acted


def _left(turns: list[dict], actions: Optional[list[str]]
          ) -> tuple[list[TurnRecord], set[int]]:
  """A session's recorded turns, and those the agent left (`TrajectoryManager.abandoned`:
  a retry's, a best-of-n's others)."""
  records = [TurnRecord.from_result(t) for t in turns]
  probe = TrajectoryManager("", acted_on=_acted_on(actions) if actions is not None else None)
  for r in records:
    probe.add_turn(r)
  return records, probe.abandoned()


def _steps_of(turns: list[dict], actions: Optional[list[str]]
              ) -> tuple[list[TurnRecord], list[int]]:
  """A session's recorded turns, and each one's environment step (`_step_numbers`)."""
  records, left = _left(turns, actions)
  return records, _step_numbers(records, left, actions)


def collect_session(turns: list[dict], *, session_id: str, task_id: str, group_id: str = "",
                    actions: Optional[list[str]] = None,
                    steps_of: Optional[tuple[list[TurnRecord], list[int]]] = None,
                    **outcome: Any) -> list[Segment]:
  """Segments from the turns a server recorded for a session (`GET /sessions/{id}`).

  A black-box agent may call the gateway more than once for one environment step (a
  retry, a best-of-n): the replies it left train nothing (`TrajectoryManager.abandoned`),
  and turn ids count the steps the kept replies made (`_step_numbers`: a side call is
  no step), so per-turn rewards land on the turns that earned them. `actions`, the texts
  the agent handed the environment, tell which of a last step's replies it acted on.
  `steps_of`: `_steps_of(turns, actions)`, where the caller has it."""
  acted_on = _acted_on(actions) if actions is not None else None
  records, steps = steps_of or _steps_of(turns, actions)
  manager = TrajectoryManager(session_id, task_id=task_id, group_id=group_id,
                              acted_on=acted_on)
  for r, turn in zip(records, steps):
    manager.add_turn(r, turn)
  return manager.segments(**outcome)


def _gateway_errors(api: str) -> tuple[type[Exception], ...]:
  """What the agent's client raises when the gateway fails (down, overloaded, a turn it
  could not finish: an error status, or an error event in a stream)."""
  import httpx

  errors: list = [httpx.HTTPError]
  for library in ([BLACKBOX_CLIENTS[api]] if api in BLACKBOX_CLIENTS else
                  ["openai", "anthropic"]):  # (a harness of your own: either client's)
    with contextlib.suppress(ImportError):
      errors.append(importlib.import_module(library).APIError)
  return tuple(errors)


def _session_url(gateway_url: str, session_id: str) -> str:
  """A session's record on a server or router (any character of the id, quoted)."""
  return f"{gateway_url}/sessions/{quote(session_id, safe='')}"


async def _take_session(gateway_url: str, session_id: str,
                        control_token: Optional[str] = None,
                        record_id: Optional[str] = None) -> list[dict]:
  """The turns the server recorded for a session; the record is then deleted (a control
  call: it carries `control_token`). `record_id`: the record's id as its episode's first
  step saw it (`_record_id`): another one now is a record made anew meanwhile."""
  import httpx

  async with httpx.AsyncClient(timeout=60, verify=shared_tls()) as client:
    r = await client.get(_session_url(gateway_url, session_id))
    r.raise_for_status()
    try:
      got = r.json()  # (once: a long episode's record is megabytes of JSON)
      turns, now = got["turns"], got.get("record_id")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      raise InfraError("server", f"the gateway's record of session {session_id!r} is not "
                       f"one ({type(e).__name__}: {e}): {r.text[:200]}") from None
    gone = await client.delete(_session_url(gateway_url, session_id),
                               headers=control.headers(control_token))
  if gone.status_code not in (200, 404):  # (the turns are taken: the episode stands)
    print(f"warning: session {session_id!r}'s record was taken but not deleted (HTTP "
          f"{gone.status_code}: {gone.text[:200]}); it stays until the server lets it go",
          file=sys.stderr, flush=True)
  _check_turns(turns, session_id)
  _check_whole(turns, session_id)
  if record_id is not None and now is not None and now != record_id:
    # (dropped and made anew past the store's marks of what it dropped: a flood of other
    # sessions, or a delete; its later turns alone were trained as the whole episode,
    # its rewards on the wrong turns: a reviewer)
    raise InfraError("session_evicted", (
        f"the gateway's record of session {session_id!r} was made anew while its episode "
        f"played (record {record_id} at its first step, {now} at its end): the turns it "
        "holds are not the whole episode; raise serving.max_sessions, or look for a client "
        "making many sessions"))
  return turns


async def _record_id(gateway_url: str, session_id: str) -> Optional[str]:
  """The id of the gateway's record of a session now (None where it holds none, or
  does not say). (A read the gateway answers at once: not the policy's time to spend.)"""
  made = (await _session_head(gateway_url, session_id, timeout=10)).get("record_id")
  return made if isinstance(made, str) else None


async def _session_head(gateway_url: str, session_id: str, timeout: float) -> dict:
  """What the gateway says of a session's record without its turns (its count and id),
  {} where it holds none or cannot be read."""
  import httpx

  try:
    async with httpx.AsyncClient(timeout=timeout, verify=shared_tls()) as client:
      r = await client.get(_session_url(gateway_url, session_id), params={"since": 1 << 62})
    got = r.json() if r.status_code == 200 else {}
  except (httpx.HTTPError, ValueError):
    return {}
  return got if isinstance(got, dict) else {}


# A recorded turn's lists, and the types of their values.
def _check_turns(turns: Any, session_id: str) -> None:
  """Raises InfraError where a turn of the gateway's record is no turn (a field missing,
  of the wrong type, lengths that differ): a server's or router's bug, or another
  gateway's; it stopped the run as the episode's bug, and is the infrastructure's."""
  if not isinstance(turns, list):
    raise InfraError("server", f"the gateway's record of session {session_id!r} holds "
                     f"{type(turns).__name__}, not a list of turns")
  for i, t in enumerate(turns):
    try:
      TurnRecord.checked(t)
    except ValueError as e:
      raise InfraError("server", f"the gateway's record of session {session_id!r}: turn "
                       f"{i} is no turn ({e})"[:300]) from None


# The serving setting behind each bound of a server's session store.
_STORE_BOUNDS = {"bytes": "serving.session_max_bytes", "count": "serving.max_sessions",
                 "ttl": "serving.session_ttl_s"}


def _check_whole(turns: Any, session_id: str) -> None:
  """Raises InfraError where the server dropped the session's record while its episode
  played (a bound of its session store: `lost_before` on the first turn it holds): the
  turns it holds are the episode's later ones only. Trained as the whole episode, its
  first turns were missing, its turn ids numbered the turns left and its per-turn
  rewards landed on the wrong ones (a reviewer)."""
  first = turns[0] if isinstance(turns, list) and turns and isinstance(turns[0], dict) else {}
  lost = first.get("lost_before")
  if not lost:
    return
  lost = lost if isinstance(lost, dict) else {}
  bound = _STORE_BOUNDS.get(lost.get("reason"), "the session store's bounds")
  raise InfraError("session_evicted", (
      f"the gateway dropped session {session_id!r}'s record while its episode played "
      f"({lost.get('turns', '?')} turns, by its {lost.get('reason', '?')} bound): the turns it "
      f"holds are not the whole episode; raise {bound}"))


async def _clear_session(gateway_url: str, session_id: str,
                         control_token: Optional[str] = None) -> None:
  """Deletes what the server holds under `session_id` before an episode plays it: turns
  of an attempt that died before its record was taken (a run killed and resumed plays
  its groups under the same ids) would be trained with this episode's reward."""
  import httpx

  try:
    async with httpx.AsyncClient(timeout=60, verify=shared_tls()) as client:
      r = await client.delete(_session_url(gateway_url, session_id),
                              headers=control.headers(control_token))
  except httpx.HTTPError as e:
    raise InfraError("server", f"clearing session {session_id!r}: {type(e).__name__}: {e}"
                     ) from e
  if r.status_code not in (200, 404):  # 404: nothing recorded, as it should be
    raise InfraError("server", f"clearing session {session_id!r}: HTTP {r.status_code}"
                     + (f": {r.text[:300]}" if r.status_code == 401 else ""))


class SamplingMismatch(Exception):
  """A black-box agent sampled turns otherwise than the run's `agent` sampling says."""

  said_whole = True  # (its message is all there is to say: no traceback, EpisodeBug.say)


def check_sampling(turns: list[dict], cfg: AgentConfig, session_id: str) -> None:
  """Every recorded turn was sampled as the run trains (temperature, top_p, top_k): the
  learner scores tokens at `agent.temperature` against the recorded log-probs, so a
  harness sampling its own way (greedy: log-prob 0 for every token) would train on
  another distribution's ratios. A harness that does is a bug: it stops the run."""
  want = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k}
  for i, t in enumerate(turns):
    got = {k: (t.get("sampling") or {}).get(k) for k in want}
    if any(got[k] is None or abs(float(got[k]) - float(v)) > 1e-6 for k, v in want.items()):
      raise SamplingMismatch(
          f"turn {i} of black-box session {session_id} was sampled with "
          f"{got}; the run trains at agent {want}: the agent must pass the run's sampling "
          "to the gateway")


def _say_long_turns(turns: list[dict], cfg: AgentConfig) -> None:
  """Says, once, that a harness let its turns run past `agent.max_new_tokens` (the
  budget it is given: a new user's harness asked for a million, and trained replies of
  160 tokens in a run set to 1)."""
  longest = max((len(t.get("output_ids") or ()) for t in turns), default=0)
  if longest > cfg.max_new_tokens:
    _say_once("long_turns", f"the black-box agent's turns run past agent.max_new_tokens "
              f"({cfg.max_new_tokens}; one of {longest} tokens): it is given the budget as "
              "max_tokens and trains what it asks for")


def _played(turns: list[dict], actions: list[str], at_end: Optional[int] = None) -> list[dict]:
  """The turns of an episode whose environment ended, through the one whose reply made
  its last step: a harness's calls after it (chatting on) are no step of it. Trained,
  they were text the environment never saw; and one that outgrew the context made a
  graded episode a truncation, a fail. `at_end`: the turns the gateway held as the
  environment ended (those after it are cut, but for other samples of the last one's
  prompt, a best-of-n's: untrained); where it is not known, the replies handed tell."""
  if at_end is not None and 0 < at_end <= len(turns):
    last = turns[at_end - 1].get("prompt_ids")
    kept = turns[:at_end] + [t for t in turns[at_end:] if t.get("prompt_ids") == last]
    if len(kept) < len(turns):
      _say_past_the_end()
    return kept
  records, left = _left(turns, actions)
  steps = _matched_steps(records, left, actions)
  made = [i for i, step in enumerate(steps or []) if step < len(actions) and i not in left]
  if not made:  # (replies not handed as they came: which came after the end is not known,
    # and a harness's side calls counted as steps cut the reply that ended it; a reviewer)
    return turns
  # (a sample of the last step's prompt recorded after the reply acted on, a best-of-n's
  # other, is of the play: it trains nothing)
  last = records[made[-1]].prompt_ids
  kept = [t for t, r, step in zip(turns, records, steps)
          if step < len(actions) or r.prompt_ids == last]
  if len(kept) < len(turns):
    _say_past_the_end()
  return kept


def _say_past_the_end() -> None:
  _say_once("past_the_end", "a black-box agent called the gateway after its environment's "
            "episode ended: those turns are not trained, and what they met (a context "
            "outgrown, the deadline) is not the episode's")


async def _session_count(gateway_url: str, session_id: str) -> Optional[int]:
  """How many turns the gateway holds of a session now (None where it does not say)."""
  count = (await _session_head(gateway_url, session_id, timeout=30)).get("count")
  return count if type(count) is int else None


def _segments_from_session(ep: Episode, turns: list[dict], task, cfg: AgentConfig,
                           tokenizer: Optional[Tokenizer], actions: list[str],
                           outcome: float = 0.0) -> None:
  """Fills `ep`'s turn counts and segments from the server's record of its session,
  with the episode's outcome (status, rewards, verdict) as it stands; `outcome`: a cut
  episode's (`Env.cut_reward`), added to its last step's reward once they are padded."""
  check_sampling(turns, cfg, ep.session_id)
  _say_long_turns(turns, cfg)
  ep.turns = len(turns)
  ep.output_tokens = sum(len(t["output_ids"]) for t in turns)
  # A per-turn reward for each step its turns make, the one a cut stopped (or a call
  # after its last action) scored 0 too, as the white-box agent pads (padded to its
  # gateway calls, retries and side calls made steps that never were, and the chunk
  # estimator's baseline counted them; a reviewer).
  records_steps = _steps_of(turns, actions)
  steps = max(records_steps[1], default=-1) + 1
  ep.turn_rewards = list(ep.turn_rewards) + [0.0] * (steps - len(ep.turn_rewards))
  if outcome:  # (on the last step, as a verdict's: the one reward contract)
    ep.turn_rewards = trained_rewards(ep.turn_rewards, {"reward": outcome})
  ep.segments = collect_session(turns, session_id=ep.session_id, task_id=task.id,
                                group_id=ep.group_id, actions=actions,
                                steps_of=records_steps, status=ep.status,
                                reason=ep.reason, reward=ep.reward,
                                turn_rewards=list(ep.turn_rewards), verdict=ep.verdict)
  stamp(ep.segments, provenance(tokenizer, turns[0].get("tools") if turns else None, cfg,
                                 ep.verdict, task))


async def run_blackbox(env, task, gateway_url: str, cfg: AgentConfig, *, session_id: str,
                       group_id: str = "", tokenizer: Optional[Tokenizer] = None,
                       api: str = "openai", control_token: Optional[str] = None) -> Episode:
  """Plays an episode with the black-box agent that speaks `api` (`BLACKBOX_AGENTS`),
  then rebuilds it from the server's record (`tokenizer`, the server's, is named in the
  segments' provenance). Its clearing and taking of the session's record are control
  calls: they carry `control_token` (the harness is not given it)."""
  import httpx

  t_start = time.perf_counter()
  control_token = control_token or control.from_env()  # (as HttpClient: launch's)
  ep = Episode(task.id, session_id, group_id, [], [], {}, "completed")
  acting = MeasuredEnv(env, cfg.env_call_deadline_s)
  # The id as it travels in a header (ASCII only; eval ids hold task ids), with a secret
  # part: the scheduler's ids are predictable (`g<group>-<i>-r<attempt>`), and an agent
  # that wrote its turns into a sibling's session had them trained with the sibling's
  # reward, and one that handed a sibling's session a forged prompt (`/handover`) had it
  # sampled under a context its environment never gave (red team 29).
  # (an id of more than 512 characters goes as its hash: the secret's 25 put a long eval
  # id past the router's 1,024)
  wire_id = (session_id if session_id.isascii() and session_id.isprintable()
             else quote(session_id, safe=""))
  if len(wire_id) > 512:
    wire_id = "sha256-" + hashlib.sha256(wire_id.encode()).hexdigest()[:32]
  wire_id += "~" + secrets.token_hex(12)

  at_end: dict = {}  # the turns the gateway held as the environment ended

  async def count_at_end() -> None:
    at_end["turns"] = await _session_count(gateway_url, wire_id)

  acting.on_end = count_at_end
  record: dict = {}  # the record's id at the first step (its first reply is in it)

  async def note_record() -> None:
    record["id"] = await _record_id(gateway_url, wire_id)

  acting.on_first_step = note_record
  decoding: dict = {}  # at a cut: request id -> how long it had decoded, in flight
  at_cut: dict = {}  # and whether nothing was under way but the harness's own code

  async def in_flight() -> None:
    """At a cut, before the harness is cancelled (and its turn with it): the seconds the
    session's turns in flight have decoded (first token to latest), the policy's time."""
    now = await gateway_progress(gateway_url, wire_id)
    # (nothing in flight, nor an environment call: the harness's own code held it)
    at_cut["idle"] = now is not None and not now.get("requests") and not acting.in_call
    # (a gateway that does not say: the turn in flight counts as the server's)
    by_request = (now or {}).get("by_request")
    if isinstance(by_request, dict):
      decoding.update({str(k): reported_seconds(v) for k, v in by_request.items()})

  def lost(e: Exception) -> None:
    ep.status, ep.reason, ep.infra_error, ep.infra_kind = (
        "failed", f"session record lost: {type(e).__name__}: {e}"[:300], True,
        getattr(e, "kind", "server"))

  async def truncated(reason: str, turns: Optional[list[dict]] = None) -> None:
    """The episode ended by its own doing before its answer: trained as a fail, the
    process rewards its steps earned kept (as the white-box agent's; `turns`: its
    session's record, when taken already)."""
    ep.status, ep.reason = "truncated", reason
    ep.verdict = {"status": "fail", "reward": acting.cut_reward}
    try:  # the turns it played still carry the score: stalling must not hide them
      if turns is None:
        turns = await _take_session(gateway_url, wire_id, control_token, record.get("id"))
      ep.turn_rewards = list(acting.rewards)  # (padded to its steps with its segments)
      _segments_from_session(ep, turns, task, cfg, tokenizer, acting.actions,
                             outcome=acting.cut_reward)
    except (httpx.HTTPError, KeyError, ValueError, InfraError) as e:
      lost(e)

  try:
    await _clear_session(gateway_url, wire_id, control_token)
    try:
      with acting.episode():  # (the harness's own code's holds of the loop are its own)
        harness = asyncio.ensure_future(blackbox_agent(api)(
            acting, task, gateway_url, session_id=wire_id, max_turns=cfg.max_turns,
            max_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
            top_k=cfg.top_k, turn_timeout_s=cfg.turn_deadline_s))
        await waits.within(harness, acting.waited, cfg.episode_deadline_s,
                           EPISODE_WALL_FACTOR * cfg.episode_deadline_s, t_start,
                           look_s=0.25, on_cut=in_flight)
    except (asyncio.TimeoutError, waits.WallCut, InfraError, *_gateway_errors(api)):
      if not acting.ended:
        raise
      # (met chatting on after its environment ended, a turn's deadline too: the episode
      # is graded as played)
    # The environment's rewards as its steps returned them, not the harness's list (one
    # that returned [1000.0] for a step the environment gave 0 had it trained: red team 29)
    ep.turn_rewards = list(acting.rewards)
    ep.verdict = (await graded(acting.verify(), cfg, acting.waited)).to_dict()
    if ep.verdict.get("status") != "infra_error":
      ep.turn_rewards = trained_rewards(ep.turn_rewards, ep.verdict)
    try:
      turns = await _take_session(gateway_url, wire_id, control_token, record.get("id"))
    except httpx.HTTPStatusError as e:  # (a harness whose calls lack the session header)
      if e.response.status_code != 404:
        raise
      raise InfraError("no_turns_recorded", f"the agent stepped its environment "
                       f"{len(acting.actions)} times and no turn of it was recorded under "
                       "its session: its calls must carry the header X-Session-Id") from None
    if acting.ended:
      turns = _played(turns, acting.actions, at_end.get("turns"))
    if ep.verdict.get("status") == "infra_error":
      ep.status, ep.reason, ep.infra_error, ep.infra_kind = "failed", "verifier_infra_error", \
          True, "verifier"
    elif acting.truncation is not None:  # (the environment's own cut)
      ep.status, ep.reason = "truncated", acting.truncation
    elif ep.verdict.get("status") != "pass" and not acting.ended \
        and len(acting.actions) >= cfg.max_turns:
      # (its steps, not its gateway calls: a harness's side calls and retries counted
      # as turns read an episode its environment ended with a wrong answer as cut)
      ep.status, ep.reason = "truncated", "turn_cap"
    _segments_from_session(ep, turns, task, cfg, tokenizer, acting.actions)
  except (asyncio.TimeoutError, waits.WallCut) as cut:
    # The agent's own time (waits on shared infrastructure left out), or its wall time.
    # As in run_whitebox: spent mostly on the gateway (everything the harness did outside
    # the environment: its calls to the server, sampling, queueing), it is the
    # infrastructure's; mostly in the environment, the policy's: truncated, scored.
    # The time its turns' own tokens took (the server's record says, and for the turn
    # in flight, the server said at the cut) is the policy's.
    elapsed = time.perf_counter() - t_start
    try:
      turns = await _take_session(gateway_url, wire_id, control_token, record.get("id"))
    except httpx.HTTPStatusError as e:  # no record: cut in its first turn, or lost
      turns = [] if e.response.status_code == 404 and not acting.actions else e
    except (httpx.HTTPError, KeyError, ValueError, InfraError) as e:
      turns = e
    if isinstance(turns, Exception):
      lost(turns)
    else:
      recorded = [t for t in turns if isinstance(t, dict)]
      # (a turn that ended after the look at the cut is in the record: counted once)
      done = {i for t in recorded for i in [t.get("request_id"), *(t.get("part_ids") or [])]}
      ep.decode_s = min(elapsed, sum(v for k, v in decoding.items() if k not in done)
                        + sum(reported_seconds(t.get("decode_s")) for t in recorded))
      server_s = max(0.0, elapsed - acting.env_s - acting.waited_s - ep.decode_s)
      kind, infra = judge_cut(cut, server_s, "on the gateway", acting, ep.decode_s)
      if infra and at_cut.get("idle"):
        kind, infra = "agent_stuck", (
            f"cut at {elapsed:.0f} s with no request on the gateway and no environment call "
            "under way: the agent's own code held the episode")
      if infra:
        ep.status, ep.reason, ep.infra_error, ep.infra_kind = "failed", infra, True, kind
      else:
        await truncated(kind, turns)
  except InfraError as e:
    ep.status, ep.reason, ep.infra_error, ep.infra_kind = "failed", str(e)[:300], True, e.kind
  except _gateway_errors(api) as e:
    said = f"{e} {getattr(e, 'body', '')}"
    if getattr(e, "status_code", None) == 400 and PROMPT_TOO_LONG in said:
      if not acting.actions:  # its first request, before the policy wrote a token
        ep.unfit = (f"task {task.id!r} ({task.env}): the agent's first request does not fit "
                    f"the server ({said.strip()[:200]}): raise serving.engine."
                    "max_prefill_length and max_seq_len, and data.seq_len")
      # The conversation outgrew the engine: its own length (or the task's first prompt).
      await truncated(FIRST_PROMPT_TOO_LONG if not acting.actions else "token_cap")
    else:  # the gateway failed (down, overloaded, cut), or refused what the agent sent
      response = getattr(e, "response", None)
      status = getattr(e, "status_code", None) or getattr(response, "status_code", None)
      body = getattr(e, "body", None) or (
          response.text[:300] if isinstance(e, httpx.HTTPStatusError) else "")
      ep.status, ep.reason, ep.infra_error, ep.infra_kind = (
          "failed", (f"the gateway answered the agent's request {status}: {body}"
                     if status else f"{type(e).__name__}: {e}")[:300], True,
          "gateway_refused" if status in (400, 404, 405, 422) else "server")
  finally:
    await acting.end(ep)
  ep.latency_s = time.perf_counter() - t_start
  return ep
