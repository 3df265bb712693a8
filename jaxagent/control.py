"""The run's control token: who may change what a rollout server serves.

A server's and a router's control routes (`POST /update_weights`, `POST /abort`,
`POST /handover`, `DELETE /sessions/{id}`) change what every client gets: the policy,
a turn in flight, the tokens a session goes on from, a session's record. With a token
set, they answer only a call whose `X-Control-Token` header holds it (401 otherwise);
`GET /control` is one that changes nothing, to check a token with.
The gateway's routes (chat, messages, responses, generate, score, and the reads) take
none: an agent given the gateway's address reaches the model, not its controls.

The token is the environment variable JAXAGENT_CONTROL_TOKEN of the servers, the
router and the learner: `python -m jaxagent.launch local` makes a fresh one for the
processes it starts, a GKE deploy keeps one in a Secret, and a training run's
in-process gateway makes its own. Unset, a server's control routes are open, and it
says so when it starts. Standard library only (a client imports it).
"""

from __future__ import annotations

import hmac
import os
import secrets
from typing import Optional

ENV = "JAXAGENT_CONTROL_TOKEN"
HEADER = "X-Control-Token"


def from_env() -> Optional[str]:
  """The token the environment gives this process (None: unset or blank)."""
  return os.environ.get(ENV, "").strip() or None


def new_token() -> str:
  """A fresh token: 256 random bits, URL-safe."""
  return secrets.token_urlsafe(32)


def headers(token: Optional[str]) -> dict:
  """The headers a control call carries (none without a token)."""
  return {HEADER: token} if token else {}


def allows(token: Optional[str], given: Optional[str]) -> bool:
  """Whether a call carrying `given` may use a control route of a process holding
  `token` (any call, where it holds none). Compared in constant time."""
  if not token:
    return True
  return given is not None and hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                                                   token.encode("utf-8", "surrogateescape"))


def refusal(given: Optional[str]) -> str:
  """What a refused control call is told (never the token)."""
  why = "has no" if given is None else "holds the wrong"
  return (f"control route: the call {why} {HEADER} header; the run's processes share "
          f"the token in {ENV}")


def describe(token: Optional[str]) -> str:
  """One line for a server's start: whether its control routes are guarded."""
  if token:
    return f"control routes take the {HEADER} header ({ENV})"
  return (f"control routes are open ({ENV} unset or blank): serve only where the run's "
          "own processes reach")
