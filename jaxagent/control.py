"""The run's tokens: who may change what a rollout server serves, and who may open
sessions on an environment worker.

A server's and a router's control routes (`POST /update_weights`, `POST /abort`,
`POST /handover`, `DELETE /sessions/{id}`) change what every client gets: the policy,
a turn in flight, the tokens a session goes on from, a session's record. With a token
set, they answer only a call whose `X-Control-Token` header holds it (401 otherwise);
`GET /control` is one that changes nothing, to check a token with.
The gateway's routes (chat, messages, responses, generate, score, and the reads) take
none: an agent given the gateway's address reaches the model, not its controls.

An environment worker's session routes (`/sessions...`) run the policy's code in its
sandboxes: with a token of its own set (`JAXAGENT_ENV_TOKEN`, header `X-Env-Token`),
they answer only the run's learners; `GET /access` checks it. It is another token than
the servers': a worker holds the environments' token, never the policy's controls.

Each token is an environment variable of the processes that share it: `python -m
jaxagent.launch local` makes fresh ones for the processes it starts, a GKE deploy keeps
them in Secrets, and a training run's in-process gateway makes its own control token.
Unset, the routes are open, and a server or worker says so when it starts. Standard
library only (a client imports it).
"""

from __future__ import annotations

import dataclasses
import hmac
import os
import secrets
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Key:
  """One of the run's tokens: the variable that gives it, the header a call carries it
  in, the routes it guards and who shares it (for the messages)."""

  env: str
  header: str
  routes: str
  holders: str

  def from_env(self) -> Optional[str]:
    """The token the environment gives this process (None: unset or blank), or held
    out of it (`hold_tokens`)."""
    return os.environ.get(self.env, "").strip() or _held.get(self.env) or None

  def headers(self, token: Optional[str]) -> dict:
    """The headers a guarded call carries (none without a token)."""
    return {self.header: token} if token else {}

  def refusal(self, given: Optional[str]) -> str:
    """What a refused call is told (never the token)."""
    why = "has no" if given is None else "holds the wrong"
    return (f"{self.routes}: the call {why} {self.header} header; {self.holders} share "
            f"the token in {self.env}")

  def describe(self, token: Optional[str]) -> str:
    """One line for a process's start: whether its guarded routes are."""
    if token:
      return f"{self.routes}s take the {self.header} header ({self.env})"
    return (f"{self.routes}s are open ({self.env} unset or blank): serve only where the "
            "run's own processes reach")


CONTROL = Key("JAXAGENT_CONTROL_TOKEN", "X-Control-Token", "control route",
              "the run's processes")
ENVS = Key("JAXAGENT_ENV_TOKEN", "X-Env-Token", "environment session route",
           "the run's learners and environment workers")

# The control token's, as its callers name them.
ENV, HEADER = CONTROL.env, CONTROL.header
from_env, headers, refusal, describe = (CONTROL.from_env, CONTROL.headers, CONTROL.refusal,
                                        CONTROL.describe)


# The tokens a process took out of its environment (`hold_tokens`).
_held: dict[str, str] = {}


def hold_tokens() -> None:
  """Takes the run's tokens out of this process's environment, kept for `from_env`: a
  learner's black-box harness that starts a program (a coding agent's command line) gave
  it both tokens with the environment it inherits (a reviewer), and the harness is not
  given them."""
  for key in (CONTROL, ENVS):
    token = os.environ.pop(key.env, "").strip()
    if token:
      _held[key.env] = token


OPEN_FLAG = "--open-routes"


def open_beyond_this_machine(key: Key, token: Optional[str], host: str) -> Optional[str]:
  """Why a process must not start listening on `host` with `key`'s routes open (None:
  it holds a token, or `host` is this machine's loopback alone): a server's control
  routes or a worker's session routes answered anyone who could reach it (a reviewer:
  loading any file as weights, running code in its sandboxes). `OPEN_FLAG` serves them
  open all the same, where a network of its own guards them."""
  import ipaddress

  if token or host == "localhost":
    return None
  try:
    if ipaddress.ip_address(host.strip("[]")).is_loopback:
      return None
  except ValueError:  # (a host name: reachable beyond this machine, as far as known)
    pass
  return (f"listening on {host} (beyond this machine) with {key.env} unset: its "
          f"{key.routes}s would answer anyone who reaches it; set {key.env} ("
          f"{key.holders} share it), listen on 127.0.0.1, or give {OPEN_FLAG} where a "
          "network of its own guards it")


def env_problem() -> Optional[str]:
  """Why a token this process's environment gives cannot go in a header (None: each is
  unset or fine). A process's `main` says it and stops (a token with a space or a
  non-ASCII character failed each call, or passed a start check as a worker not up)."""
  for key in (CONTROL, ENVS):
    token = key.from_env()
    if token and not all("!" <= c <= "~" for c in token):
      return (f"{key.env}: a token is visible ASCII without spaces (it goes in the "
              f"{key.header} header); the one set holds other characters")
  return None


def new_token() -> str:
  """A fresh token: 256 random bits, URL-safe."""
  return secrets.token_urlsafe(32)


def allows(token: Optional[str], given: Optional[str]) -> bool:
  """Whether a call carrying `given` may use a guarded route of a process holding
  `token` (any call, where it holds none). Compared in constant time."""
  if not token:
    return True
  return given is not None and hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                                                   token.encode("utf-8", "surrogateescape"))
