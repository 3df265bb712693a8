"""Clients of a rollout server, with the same async methods in-process and over HTTP.

The learner talks to rollout servers only through these: `generate` (token
ids in, a `TurnRecord` out), `update_weights` (load a policy export), `score`
(a served model's log-probs of given tokens: a reference, a teacher), `stats`.
`LocalClient` wraps an in-process orchestrator; `HttpClient` a server or a
router URL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Optional
from urllib.parse import quote

import httpx

from jaxagent import control
from jaxagent.errors import PROMPT_TOO_LONG, InfraError
from jaxagent.pools import CountedPool
from jaxagent.tls import shared_tls
from jaxagent.trajectory import TurnRecord
from rollout_server.engine import Engine, SamplingParams
from rollout_server.orchestrator import (ENGINE_DEAD, EngineDead, Orchestrator, PromptTooLong,
                                         QueueFull, Request, progress_of)
from rollout_server.routing import MAX_SCORE_TOKENS, NONE_AVAILABLE

log = logging.getLogger(__name__)


class GenerateError(InfraError):
  """The server could not serve the request (an infrastructure failure, not the model's)."""

  def __init__(self, message: str, kind: str = "server"):
    super().__init__(kind, message)


def _partly_made(r: httpx.Response, version: int) -> Optional[dict]:
  """A router's 502 of an update some backends took (its `version` the one sent): the
  answer, its refusals said in a warning (those backends are out of rotation until they
  load it); None for any other answer."""
  if r.status_code != 502:
    return None
  try:
    got = r.json()
  except ValueError:
    return None
  if not (isinstance(got, dict) and got.get("version") == version
          and isinstance(got.get("results"), list)):
    return None
  results = [x for x in got["results"] if isinstance(x, dict)]
  if not any(x.get("status") == 200 and isinstance(x.get("body"), dict)
             and x["body"].get("version") == version for x in results):
    return None  # (none took it: the version is the router's own, pinned before)
  failed = [x for x in results if x.get("status") != 200 and "skipped" not in x]
  if any(isinstance(x.get("status"), int) and (400 <= x["status"] < 500 or x["status"] == 501)
         for x in failed):
    return None  # (a token refused, no export there, another model: the run's error)
  log.warning("%s: version %s taken, but not by %s: out of rotation until they load it",
              r.url, version,
              ", ".join(f"{x.get('backend')} ({x.get('status') or x.get('error')})"
                        for x in failed) or "some backends")
  return got


def _other_model(r: httpx.Response) -> bool:
  """Whether an /update_weights answer says a server serves another model than the
  export's (its 409, or a router's result of one)."""
  if r.status_code == 409:
    return True
  try:
    results = r.json().get("results")
  except (ValueError, AttributeError):
    return False
  return isinstance(results, list) and any(
      isinstance(x, dict) and x.get("status") == 409 for x in results)


async def control_problem(client: httpx.AsyncClient, url: str, health,
                          token: Optional[str]) -> Optional[str]:
  """What stops a process holding `token` from using the control routes of the server
  or router at `url` whose /health answered `health` (parsed), asking its `GET /control`
  with the token where it takes one; None: nothing (or nothing it can tell)."""
  if not isinstance(health, dict):
    return None
  if health.get("control_token"):
    if not token:
      return (f"{url} takes a control token ({control.HEADER}) on its control routes and "
              f"this process has none: give it the servers' {control.ENV}")
    try:
      r = await client.get(f"{url}/control", headers=control.headers(token), timeout=10.0)
    except httpx.HTTPError:
      return None  # (its first control call will say)
    if r.status_code in (401, 403):
      return (f"{url} refuses this process's control token: its {control.ENV} differs "
              "from the servers'")
  if health.get("backends_need_token"):
    return (f"the router at {url} cannot use its servers' control routes ("
            f"{', '.join(map(str, health['backends_need_token']))} refuse its token): start "
            f"it with their {control.ENV}")
  return None


def _record(r: dict) -> TurnRecord:
  return TurnRecord.from_result(r)


def _check_scores(model: str, sequences, scores) -> list:
  if not isinstance(scores, list) or len(scores) != len(sequences) or any(
      len(s) != len(q) for s, q in zip(scores, sequences)):
    raise GenerateError(f"model {model!r}: scores do not match the sequences sent")
  return scores


class LocalClient:
  def __init__(self, orchestrator: Orchestrator, engine: Engine, load_params=None,
               models: Optional[dict] = None):
    self.orch = orchestrator
    self.engine = engine
    self._load = load_params
    self.models = models or {}  # name -> rollout_server.serving.ServedModel
    # Weight loads and scoring on a thread of their own: the loop's default executor is
    # shared with environments' calls, and a swap or a step's scores queued behind them
    # (for ever, behind calls that never end).
    # (counted: one stuck at the command's end is left behind, not joined for ever)
    self._work = CountedPool(1, "jaxagent-run-serving")

  def _served(self, model: str):
    if model not in self.models:
      raise GenerateError(f"no served model {model!r} (have {sorted(self.models)})",
                          "request_refused")
    return self.models[model]

  async def score(self, model: str, sequences: list[list[int]],
                  temperature: float = 1.0) -> list[list[float]]:
    """The served model `model`'s log-prob of every token of each sequence (0 for the
    first), at `temperature`."""
    served = self._served(model)
    loop = asyncio.get_running_loop()
    out = await loop.run_in_executor(self._work, served.score, sequences, temperature)
    return _check_scores(model, sequences, [x.tolist() for x in out])

  async def generate(self, prompt_ids: list[int], sampling: SamplingParams,
                     session_id: Optional[str] = None, model: Optional[str] = None,
                     resumed_tokens: int = 0, request_id: Optional[str] = None) -> TurnRecord:
    """A turn of the policy, or of the served model `model`; `resumed_tokens` > 0 resumes
    a cut turn whose sampled tokens end the prompt (`Orchestrator.submit`); `request_id`
    names it for `progress`."""
    orch = self.orch if model is None else self._served(model).orch
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def done(req: Request, _n):
      if req.done and not fut.done():
        loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))

    try:
      req = orch.submit(prompt_ids, sampling, request_id=request_id, session_id=session_id,
                        resumed_tokens=resumed_tokens)
    except EngineDead as e:  # (not a full queue: a restart is the remedy)
      raise GenerateError(str(e), "engine_dead") from e
    except QueueFull as e:
      raise GenerateError(str(e), "server_overload") from e
    except PromptTooLong as e:  # the conversation outgrew the engine: not the server's fault
      raise GenerateError(str(e), "prompt_too_long") from e
    except ValueError as e:
      raise GenerateError(str(e), "request_refused") from e
    except RuntimeError as e:
      raise GenerateError(str(e)) from e
    req.add_listener(done)
    if not req.done:
      try:
        await fut
      except asyncio.CancelledError:
        orch.abort(req.request_id)
        raise
    if req.finish_reason == "error":
      raise GenerateError(req.error or "engine error")
    return _record(req.result())

  async def progress(self, request_id: str) -> Optional[dict]:
    """Where a request in flight stands (`Orchestrator.progress`); None when none is."""
    return progress_of([self.orch, *(m.orch for m in self.models.values())], request_id)

  async def update_weights(self, path: str, version: int, mode: str = "drain") -> dict:
    """Loads a policy export and swaps it in."""
    return await self._swap(lambda: self.engine.load_params(path=path, version=version), mode)

  async def load_weights(self, params, version: int, mode: str = "drain") -> dict:
    """Swaps in `params` (a pure dict, host or device; not aliased by the caller later)
    without a file: the in-process path of a training run."""
    return await self._swap(lambda: self.engine.load_params(params, version=version), mode)

  async def _swap(self, load, mode: str) -> dict:
    """Engine params from `load()`, then the orchestrator's swap; timings in seconds."""
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    engine_params = await loop.run_in_executor(self._work, load)
    load_s = time.perf_counter() - t0
    report = await loop.run_in_executor(self._work, self.orch.update_weights, engine_params,
                                        mode)
    return {**report, "load_s": load_s}

  async def stats(self) -> dict:
    return self.orch.stats()

  async def aclose(self) -> None:
    self._work.shutdown(wait=False)


class HttpClient:
  """A rollout server (or router) over HTTP. After it took a policy from this client
  (`update_weights`), a turn it serves from older weights means it lost them (restarted):
  the client loads the policy into it again and raises, so that the turn is asked again
  (on a single server, where no router catches up a server that comes back).
  `timeout_s` bounds its calls but turns: a turn is as long as its tokens (its caller
  asks how it stands, `progress`). Its control calls (update_weights) carry
  `control_token` (None: the environment's, `jaxagent.control`)."""

  def __init__(self, url: str, *, timeout_s: float = 600.0,
               control_token: Optional[str] = None, update_retry_s: float = 30.0):
    self.url = url.rstrip("/")
    self.update_retry_s = update_retry_s
    self.control_token = control_token or control.from_env()
    self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0),
                                     verify=shared_tls())
    self._policy: Optional[dict] = None  # the last update the server took
    self._updates = 0  # how many it took (a turn asked before the latest is not checked)
    self._reloading = asyncio.Lock()
    self._follows = False  # (another client updates the server: `follow_policy`)

  async def generate(self, prompt_ids: list[int], sampling: SamplingParams,
                     session_id: Optional[str] = None, model: Optional[str] = None,
                     resumed_tokens: int = 0, request_id: Optional[str] = None) -> TurnRecord:
    body = {"input_ids": list(prompt_ids), **dataclasses.asdict(sampling)}
    if resumed_tokens:
      body["resumed_tokens"] = int(resumed_tokens)
    if request_id:
      body["request_id"] = request_id
    body["stop_token_ids"] = list(sampling.stop_token_ids)
    if session_id:  # (for routing and the prefix cache: this client keeps its own record)
      body["session_id"] = session_id
      body["record"] = False
    if model:
      body["model"] = model
    updates = self._updates
    try:
      # No read timeout: a turn is as long as its tokens; the agent asks how it stands
      # (`progress`) and gives up on one that does not move.
      r = await self._client.post(f"{self.url}/generate", json=body,
                                  timeout=httpx.Timeout(None, connect=10.0))
    except httpx.HTTPError as e:
      raise GenerateError(f"{self.url}: {type(e).__name__}: {e}") from e
    if r.status_code != 200:
      kind = ("server" if r.status_code == 503 and NONE_AVAILABLE in r.text else
              # (a dead engine read as a full queue: retried as the run's own load; a
              # reviewer)
              "engine_dead" if r.status_code == 503 and ENGINE_DEAD in r.text else
              "server_overload" if r.status_code == 503 else
              "prompt_too_long" if r.status_code == 400 and PROMPT_TOO_LONG in r.text else
              "request_refused" if r.status_code < 500 else "server")
      raise GenerateError(f"{self.url}/generate: {r.status_code}: {r.text[:500]}", kind)
    try:
      out = r.json()
    except ValueError:
      out = None
    if isinstance(out, dict) and out.get("finish_reason") == "error":
      raise GenerateError(out.get("error") or "engine error")
    try:  # (a server's 200 that is no turn: its failure, not the episode's bug)
      record = TurnRecord.checked(out)
    except ValueError as e:
      raise GenerateError(f"{self.url}/generate answered 200 with no turn ({e}): "
                          f"{r.text[:200]}", "server") from None
    policy = self._policy
    if (policy is not None and model is None and updates == self._updates and record.versions
        and min(record.versions) < policy["version"]):
      # (shielded: a turn deadline must not cut a load in the middle)
      if self._follows:  # (the client that updates it loads it again)
        raise GenerateError(f"{self.url} served version {min(record.versions)} after it "
                            f"took version {policy['version']} (restarted?): asked again")
      await asyncio.shield(self._reload(updates))
      raise GenerateError(f"{self.url} served version {min(record.versions)} after it took "
                          f"version {policy['version']} (restarted?): loaded it again")
    return record

  async def progress(self, request_id: str) -> Optional[dict]:
    """Where a request in flight stands (the server's `GET /requests/{id}`); None when
    the server runs no such request. Raises GenerateError when the server does not
    answer within 10 s."""
    try:
      r = await self._client.get(f"{self.url}/requests/{quote(request_id, safe='')}",
                                 timeout=10.0)
    except httpx.HTTPError as e:
      raise GenerateError(f"{self.url}: asking how a turn stands: {type(e).__name__}: {e}"
                          ) from e
    if r.status_code == 404:
      return None
    if r.status_code != 200:
      raise GenerateError(f"{self.url}/requests: {r.status_code}: {r.text[:300]}")
    return r.json()

  async def _reload(self, updates: int) -> None:
    """Loads the policy into the server again, unless an update came since `updates`
    (the turn that found it stale was asked before), or the server serves it already, or
    does not say which version it serves (a router: it catches its servers up itself)."""
    async with self._reloading:
      if updates != self._updates or self._policy is None:
        return
      policy = dict(self._policy)
      try:
        health = (await self._client.get(f"{self.url}/health", timeout=10.0)).json()
        served = health.get("version")
        # (not one newer than its policy: another client's update, rolled back)
        if "version" in health and served != policy["version"] and not (
            isinstance(served, int) and isinstance(policy["version"], int)
            and served > policy["version"]):
          await self._push(**policy)
      except (httpx.HTTPError, ValueError, GenerateError):
        pass  # the next turn finds out again

  async def score(self, model: str, sequences: list[list[int]], temperature: float = 1.0,
                  per_request: int = 64, max_tokens: int = MAX_SCORE_TOKENS
                  ) -> list[list[float]]:
    """As `LocalClient.score`: at most `per_request` sequences and `max_tokens` tokens a
    request (a server's limit: 64 sequences of 4,100 tokens were refused, a 413, and
    every step of a run with long episodes failed on it; a reviewer), the sequences of
    one a server refuses as too large sent in halves."""
    out, part, held = [], [], 0
    for s in sequences:
      if part and (len(part) == per_request or held + len(s) > max_tokens):
        out += await self._score(model, part, temperature)
        part, held = [], 0
      part.append(s)
      held += len(s)
    if part:
      out += await self._score(model, part, temperature)
    return out

  async def _score(self, model: str, part: list, temperature: float) -> list:
    body = {"model": model, "input_ids": [list(map(int, s)) for s in part],
            "temperature": temperature}
    try:
      r = await self._client.post(f"{self.url}/v1/score", json=body)
    except httpx.HTTPError as e:
      raise GenerateError(f"{self.url}: {type(e).__name__}: {e}") from e
    if r.status_code == 413 and len(part) > 1:  # (a server of a lower limit)
      half = len(part) // 2
      return (await self._score(model, part[:half], temperature)
              + await self._score(model, part[half:], temperature))
    if r.status_code != 200:
      kind = "request_refused" if 400 <= r.status_code < 500 else "server"
      raise GenerateError(f"{self.url}/v1/score: {r.status_code}: {r.text[:500]}", kind)
    return _check_scores(model, part, r.json().get("logprobs"))

  async def update_weights(self, path: str, version: int, mode: str = "drain") -> dict:
    async with self._reloading:  # one push at a time: a reload never lands after a newer one
      self._follows = False
      return await self._push(path, version, mode)

  async def _push(self, path: str, version: int, mode: str = "drain") -> dict:
    """The update, asked again for up to `update_retry_s` while the server cannot be
    connected to or has none to update (a router's 503: its backends out of rotation a moment,
    a restart): the first of them stopped a run on healthy servers (a new user). A
    router's 502 where some backends took the version is the update made (the others
    are out of rotation until they load it), said."""
    deadline, wait = time.monotonic() + self.update_retry_s, 0.5
    while True:
      try:
        r = await self._client.post(f"{self.url}/update_weights",
                                    json={"path": path, "version": version, "mode": mode},
                                    headers=control.headers(self.control_token))
        if r.status_code != 503:
          break
        why = f"503: {r.text[:300]}"
      except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # (never sent: asked again;
        # one sent and cut may have been taken, and another would drain the turns again)
        why = f"{type(e).__name__}: {e}"
        if time.monotonic() + wait > deadline:
          raise GenerateError(f"{self.url}/update_weights: {why}") from e
      except httpx.HTTPError as e:
        raise GenerateError(f"{self.url}/update_weights: {type(e).__name__}: {e}") from e
      if time.monotonic() + wait > deadline:
        raise GenerateError(f"{self.url}/update_weights: {why} (asked for "
                            f"{self.update_retry_s:.0f} s)")
      if wait == 0.5:
        log.warning("%s/update_weights: %s; asked again for up to %.0f s", self.url, why,
                    self.update_retry_s)
      await asyncio.sleep(wait)
      wait = min(wait * 2, 5.0)
    if r.status_code in (401, 403):  # (its text says of the call, not of the cause)
      why = ("it has none" if not self.control_token else
             f"its {control.ENV} differs from the servers'")
      raise GenerateError(f"{self.url}/update_weights refused this process's control token "
                          f"({why}): {r.status_code}: {r.text[:300]}")
    out = _partly_made(r, version)
    if r.status_code != 200 and out is None:
      # (409: a server of another model than the export's; a router says its backends')
      raise GenerateError(f"{self.url}/update_weights: {r.status_code}: {r.text[:500]}",
                          "other_model" if _other_model(r) else "server")
    out = r.json() if out is None else out
    self._policy = {"path": path, "version": version, "mode": mode}
    self._updates += 1
    return out

  async def follow_policy(self, path: str, version: int, mode: str = "drain") -> None:
    """The policy another client updated the servers to (`update_weights`): this client
    asks again a turn served from older weights (the other loads the policy into the
    server again: two loading it at once drained it twice, and one a version behind
    rolled it back; a reviewer), and its router (`POST /router/policy`) holds its
    backends to it; a server (404), or a router the other client updates (409: shared),
    is left as it is. GenerateError when the router refuses it otherwise."""
    policy = {"path": path, "version": version, "mode": mode}
    try:
      r = await self._client.post(f"{self.url}/router/policy", json=policy,
                                  headers=control.headers(self.control_token), timeout=30.0)
    except httpx.HTTPError as e:
      raise GenerateError(f"{self.url}/router/policy: {type(e).__name__}: {e}") from e
    if r.status_code not in (200, 404, 409):
      raise GenerateError(f"{self.url}/router/policy: {r.status_code}: {r.text[:300]}")
    async with self._reloading:
      self._follows = True
      if self._policy is None or self._policy["version"] != version:
        self._policy = policy
        self._updates += 1

  async def stats(self) -> dict:
    return (await self._client.get(f"{self.url}/health")).json()

  async def wait_ready(self, timeout_s: float, say=print) -> None:
    """Returns once the server (or a router with a healthy backend) answers /health with
    200; says once that it waits; GenerateError after `timeout_s`, or at once when its
    control routes refuse this client's token, none or another, or (a router) its
    servers refuse the router's (its first update would be refused)."""
    deadline, said, last = time.monotonic() + timeout_s, False, ""
    while True:
      try:
        r = await self._client.get(f"{self.url}/health", timeout=5.0)
        if r.status_code == 200:
          try:
            health = r.json()
          except ValueError:  # (not a server of ours: its first call will say)
            health = None
          if isinstance(health, dict) and not ({"live_slots", "backends"} & health.keys()):
            # (an environment worker's: its 404 on the first update read as an outage,
            # exit 3, where the reverse mistake is a setting's: a new user)
            raise GenerateError(f"{self.url} answers /health but is not a rollout server "
                                f"or router (python -m rollout_server): {r.text[:200]}",
                                "request_refused")
          problem = await control_problem(self._client, self.url, health,
                                          self.control_token)
          if problem:
            raise GenerateError(problem, "request_refused")
          if said:  # (after the checks: "ready", then a refusal, read oddly)
            say(f"{self.url} is ready")
          return
        last = f"HTTP {r.status_code}: {r.text[:200]}"
      except httpx.HTTPError as e:
        last = f"{type(e).__name__}: {e}"
      if time.monotonic() >= deadline:
        raise GenerateError(f"{self.url}/health did not answer 200 within {timeout_s:.0f} s "
                            f"(serving.startup_wait_s; last: {last})")
      if not said:
        say(f"waiting up to {timeout_s:.0f} s for {self.url} to be ready ({last})")
        said = True
      await asyncio.sleep(min(2.0, max(0.0, deadline - time.monotonic())))

  async def aclose(self) -> None:
    await self._client.aclose()
