"""What the server's chat gateways (OpenAI's chat completions and Anthropic's messages)
share: the sampling ranges a request may ask for, messages in the internal form (OpenAI's
message dicts, which the chat template renders), and one call's turn: its request, the
assistant message parsed from its output, the session record, the text streamed so far.

Each gateway converts its own request shape into the internal form and the internal
answer back into its own shape; rendering, sampling and recording are done once, here and
in `server.py`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

from pydantic import Field

from jaxagent.toolcalls import OPEN, parse_tool_calls

if TYPE_CHECKING:  # (annotations only: the router imports this module without JAX)
  from jaxagent.tokenizer import Tokenizer
  from rollout_server.orchestrator import Orchestrator, Request
  from rollout_server.sessions import SessionStore

# Ranges the engine can take: a request outside them is refused with a 422 naming the
# field, instead of failing on the device (and taking its prefill batch with it).
TOP_K = Field(0, ge=0, lt=2**31)
SEED = Field(None, ge=-(2**63), lt=2**63)
TEMPERATURE = Field(1.0, ge=0.0)
TOP_P = Field(1.0, gt=0.0, le=1.0)
TOKEN_ID = Field(ge=0, lt=2**31)


def message_text(content: Any) -> str:
  """The text of a message's content: a string, or the texts of its parts, joined."""
  if content is None:
    return ""
  if isinstance(content, str):
    return content
  if isinstance(content, list):  # OpenAI content parts
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))
  raise ValueError(f"message content must be a string or a list of parts, got {type(content)}")


def normalise_messages(messages: list[dict]) -> list[dict]:
  """The messages with a known role each and their content as one string."""
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
      raise ValueError(f"messages[{i}] needs a role of system, user, assistant or tool")
    m = dict(m)
    m["content"] = message_text(m.get("content"))
    out.append(m)
  return out


@dataclasses.dataclass
class ChatTurn:
  """One chat call in flight: its engine request and, once it ends, the assistant message
  parsed from the output (internal form: `content` and OpenAI-shaped `tool_calls`),
  recorded as a turn of the session (once) when first asked for.

  `messages` and `tools` are what was rendered into the prompt (internal form); `kind`
  names the gateway in the record; tool calls get ids `{id_prefix}_{request id}_{i}`.
  """

  req: Request
  tokenizer: Tokenizer
  orch: Orchestrator
  _: dataclasses.KW_ONLY
  messages: list[dict]
  tools: Optional[list[dict]]
  sessions: SessionStore
  session_id: Optional[str]
  kind: str
  id_prefix: str
  _message: Optional[dict] = dataclasses.field(default=None, init=False, repr=False)

  def finish(self) -> dict:
    """The assistant message of the finished request; records the turn the first time."""
    if self._message is not None:
      return self._message
    req = self.req
    ids = req.output_ids
    if ids and ids[-1] in self.tokenizer.stop_ids:
      ids = ids[:-1]
    text = self.tokenizer.decode(ids)
    parsed = parse_tool_calls(text, id_prefix=f"{self.id_prefix}_{req.request_id}")
    message = {"role": "assistant", "content": parsed.content if parsed.calls else text}
    if parsed.calls:
      message["tool_calls"] = [c.openai() for c in parsed.calls]
    if self.session_id:
      record = req.result()
      record.update(kind=self.kind, messages=self.messages, tools=self.tools, response=message,
                    tool_call_errors=parsed.errors)
      self.sessions.record(self.session_id, record)
    self._message = message
    return message

  def visible_text(self) -> str:
    """The text sampled so far that a stream may show: up to the first tool-call marker,
    less a trailing incomplete UTF-8 character (U+FFFD) and stop tokens."""
    ids = [t for t in self.req.output_ids if t not in self.tokenizer.stop_ids]
    text = self.tokenizer.decode(ids)
    cut = text.find(OPEN)
    return (text if cut < 0 else text[:cut]).rstrip("\ufffd")

  async def progress(self) -> AsyncIterator[None]:
    """Yields after each batch of new tokens, until the request ends."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    self.req.add_listener(lambda r, n: loop.call_soon_threadsafe(queue.put_nowait, n))
    while not self.req.done:
      await queue.get()
      yield

  def abort_unfinished(self) -> None:
    """Frees the request's slot if it is still running (its stream's client went away)."""
    if not self.req.done:
      self.orch.abort(self.req.request_id)
