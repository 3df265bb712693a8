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
import json
from typing import TYPE_CHECKING, Annotated, Any, AsyncIterator, Awaitable, Callable, Optional

import numpy as np
from starlette.exceptions import HTTPException  # (FastAPI's own body errors raise Starlette's)
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, Field

from jaxagent.serve_http import (NESTED_TOO_DEEP, DepthBoundRoute, invalid_json, not_json,
                                 unreadable_body)
from jaxagent.tokenizer import valid_unicode
from jaxagent.toolcalls import FINITE_JSON, OPEN, hands_out_whole, parse_tool_calls, with_calls

if TYPE_CHECKING:  # (annotations only: the router imports this module without JAX)
  from jaxagent.tokenizer import Tokenizer
  from rollout_server.orchestrator import Orchestrator, Request
  from rollout_server.sessions import LastTurn, SessionStore

# Ranges the engine can take: a request outside them is refused with a 422 naming the
# field, instead of failing on the device (and taking its prefill batch with it).
TOP_K = Field(0, ge=0, lt=2**31)
SEED = Field(None, ge=-(2**63), lt=2**63)
TEMPERATURE = Field(1.0, ge=0.0, le=100.0)  # (as /v1/score's: past it, sampling is uniform)
TOP_P = Field(1.0, gt=0.0, le=1.0)
TOKEN_ID = Field(ge=0, lt=2**31)


def _unicode_text(v: str) -> str:
  if not valid_unicode(v):  # (a JSON escape: recorded, a record that would not read;
    # echoed, an answer that could not be written, red team 24)
    raise ValueError("not valid Unicode (a lone surrogate)")
  return v


# A name a request gives (a model, a request or session id): Unicode text.
Name = Annotated[str, AfterValidator(_unicode_text)]


# Fields of other servers' APIs (OpenAI's, vLLM's, Anthropic's) that would change what is
# sampled, with the value that changes nothing: the engine samples the policy as it is
# (its log-probs are what the learner trains with), so any other value is refused,
# naming the field, not ignored (an agent would get what it did not ask for).
UNSERVED = {"logit_bias": (None, {}), "frequency_penalty": (None, 0, 0.0),
            "presence_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0),
            "min_p": (None, 0, 0.0), "min_tokens": (None, 0), "ignore_eos": (None, False),
            "bad_words": (None, []), "allowed_token_ids": (None,),
            "response_format": (None, {"type": "text"}), "guided_json": (None,),
            "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
            "structured_outputs": (None,), "thinking": (None, {"type": "disabled"}),
            "parallel_tool_calls": (None, True),
            # (vLLM's; and stop_token_ids where a route does not take it, as the
            # messages and responses routes: ignored, they changed the answer unsaid; a
            # reviewer)
            "best_of": (None, 1), "use_beam_search": (None, False),
            "continue_final_message": (None, False), "add_generation_prompt": (None, True),
            "stop_token_ids": (None, [])}


def unserved(extra: Optional[dict]) -> Optional[str]:
  """Why a request's unknown fields (`extra`) cannot be served, or None."""
  for name, value in (extra or {}).items():
    if name in UNSERVED and not any(value == v and type(value) is type(v) or value is v
                                    for v in UNSERVED[name]):
      return (f"{name}: not served (the engine samples the policy as it is; the log-probs "
              f"it returns are the policy's), got {json.dumps(value)[:100]}")
  return None


def message_text(content: Any, where: str = "content") -> str:
  """The text of a message's content: a string, or the texts of its parts, joined. A part
  that is not text (an image, audio, a file) is refused: the model would answer as if it
  had seen it."""
  if content is None:
    return ""
  if isinstance(content, str):
    return content
  if isinstance(content, list):  # OpenAI content parts
    texts = []
    for j, p in enumerate(content):
      if not isinstance(p, dict) or p.get("type", "text") != "text" or \
          not isinstance(p.get("text"), str):
        kind = p.get("type") if isinstance(p, dict) else type(p).__name__
        raise ValueError(f"{where}[{j}]: only text parts ({{'type': 'text', 'text': ...}}) "
                         f"are served, got {kind!r}")
      texts.append(p["text"])
    return "".join(texts)
  raise ValueError(f"{where} must be a string or a list of parts, got {type(content).__name__}")


def call_arguments(args: Any) -> Optional[dict]:
  """A tool call's arguments as the object they are (given as its JSON text, or as the
  object), or None where they are not an object ("" is none: {})."""
  try:
    value = (json.loads(args) if args.strip() else {}) if isinstance(args, str) else args
  except (ValueError, RecursionError):
    return None
  return value if isinstance(value, dict) else None


def _checked_calls(calls: Any, where: str) -> list[dict]:
  """An assistant message's `tool_calls` as OpenAI writes them, each call's arguments the
  JSON text of an object ("" or null read as none, as a call the model wrote without
  them; an object sent as one written as its text, so a call sent back so is the
  sampled one: it was read as another reply). ValueError naming the call otherwise:
  `"{bad"` went into the prompt as it was (the template writes the text between the
  braces of the call), and an entry that was no call failed in the template, naming no
  field (a reviewer)."""
  if not isinstance(calls, list):
    raise ValueError(f"{where} must be a list of calls, got {type(calls).__name__}")
  out = []
  for j, call in enumerate(calls):
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
      raise ValueError(f"{where}[{j}] must be a call, {{'type': 'function', 'function': "
                       "{'name': NAME, 'arguments': JSON}}")
    args = function.get("arguments")
    if args is None or isinstance(args, str) and not args.strip():
      args = "{}"
    if call_arguments(args) is None:
      raise ValueError(f"{where}[{j}].function.arguments must be a JSON object (its text, "
                       f"or the object), got {repr(args)[:100]}")
    if not isinstance(args, str):
      args = json.dumps(args, ensure_ascii=False)
    out.append(dict(call, function=dict(function, arguments=args)))
  return out


def normalise_messages(messages: list[dict]) -> list[dict]:
  """The messages with a known role each (a `developer` message is a system one, as
  OpenAI's newer clients send it) and their content as one string (only an assistant
  message that calls tools may leave it out)."""
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or m.get("role") not in ROLES:
      raise ValueError(f"messages[{i}] needs a role of system, developer, user, assistant "
                       "or tool")
    if m.get("content") is None and not (m["role"] == "assistant" and m.get("tool_calls")):
      raise ValueError(f"messages[{i}] ({m['role']}) has no content")
    m = dict(m, role="system" if m["role"] == "developer" else m["role"])
    m["content"] = message_text(m.get("content"), f"messages[{i}].content")
    if m["role"] == "assistant" and m.get("tool_calls") is not None:
      m["tool_calls"] = _checked_calls(m["tool_calls"], f"messages[{i}].tool_calls")
    out.append(m)
  return out


ROLES = ("system", "developer", "user", "assistant", "tool")


# Characters a call's messages may hold beyond their rendering (fields a chat template
# may not write: names, ids, a refusal, a harness's own), in all and per message: 20 MB
# of them in a message that rendered 8 tokens, four times, evicted another client's
# session from a 64 MiB store, since a session's record keeps them (red team 113).
MAX_UNRENDERED_CHARS, UNRENDERED_CHARS_A_MESSAGE = 64 * 1024, 1024


def _chars(value: Any) -> int:
  return len(value) if isinstance(value, str) else len(json.dumps(
      value, ensure_ascii=False, default=str))


def bound_unrendered(messages: list[dict], rendered_chars: int) -> None:
  """ValueError naming the largest field when the fields of `messages` besides role,
  content and each tool call's name and arguments (what a template surely writes) hold
  more characters than the rendering (`rendered_chars`: what a template wrote of them
  is in it) plus MAX_UNRENDERED_CHARS and UNRENDERED_CHARS_A_MESSAGE a message."""
  sizes = []
  for i, m in enumerate(messages):
    for key, value in m.items():
      if key in ("role", "content"):
        continue
      if key != "tool_calls" or not isinstance(value, list):
        sizes.append((_chars(value), f"messages[{i}].{key}"))
        continue
      for j, call in enumerate(value):
        for k, v in (call.items() if isinstance(call, dict) else ()):
          where = f"messages[{i}].tool_calls[{j}].{k}"
          if k == "function" and isinstance(v, dict):
            sizes += [(_chars(fv), f"{where}.{fk}") for fk, fv in v.items()
                      if fk not in ("name", "arguments")]
          else:
            sizes.append((_chars(v), where))
  allowed = rendered_chars + MAX_UNRENDERED_CHARS + UNRENDERED_CHARS_A_MESSAGE * len(messages)
  if sum(n for n, _ in sizes) > allowed:
    n, where = max(sizes)
    raise ValueError(f"{where}: {n} characters; the messages' fields besides role, content "
                     f"and tool calls hold {sum(n for n, _ in sizes)}, more than their "
                     f"rendering ({rendered_chars} characters) and {allowed - rendered_chars} "
                     "besides (a session's record keeps them)")


def _number(literal: str) -> Any:
  """A JSON number written with a fraction or exponent by its value: 30.0 and 1e2 as 30
  and 100, as a JavaScript client writes them again (JSON.parse then stringify: every
  call with such an argument was read as another reply, and the turn forked; a
  reviewer); whole numbers a double holds exactly only (integers stay exact)."""
  value = float(literal)
  return int(value) if value.is_integer() and abs(value) <= 2 ** 53 else value


def _json_value(text: Any) -> Any:
  try:
    return json.dumps(json.loads(text, parse_float=_number), sort_keys=True)
  except (TypeError, ValueError, RecursionError, OverflowError):
    return None


def with_sampled_arguments(messages: list[dict], calls: dict[str, str]) -> list[dict]:
  """The messages with each tool call of the session's record (`calls`: arguments' text
  by call id) carrying its arguments as the model wrote them, where the agent sent back
  the same values written otherwise (Anthropic's tool_use input is an object; some
  harnesses dump parsed arguments again): rendered from its own text, the call is the
  tokens sampled, and the turn continues them (`continued_prompt`)."""
  if not calls:
    return messages
  out = []
  for m in messages:
    tool_calls = m.get("tool_calls") if m.get("role") == "assistant" else None
    if isinstance(tool_calls, list):
      kept = []
      for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        raw = calls.get(str(call.get("id"))) if isinstance(function, dict) else None
        if (raw is not None and raw != function.get("arguments")
                and _json_value(raw) == _json_value(function.get("arguments"))):
          call = dict(call, function=dict(function, arguments=raw))
        kept.append(call)
      m = dict(m, tool_calls=kept)
    out.append(m)
  return out


def _calls(message: dict) -> Optional[list]:
  """A message's tool calls as (name, arguments' value); None if one cannot be read."""
  out = []
  for call in message.get("tool_calls") or []:
    function = call.get("function") if isinstance(call, dict) else None
    value = _json_value(function.get("arguments")) if isinstance(function, dict) else None
    if value is None:
      return None
    out.append((function.get("name"), value))
  return out


def _call_ids(message: Any) -> list:
  """A message's tool calls' ids, in order."""
  calls = message.get("tool_calls") if isinstance(message, dict) else None
  return [c.get("id") if isinstance(c, dict) else None for c in calls or []]


def _same_reply(sent: dict, recorded: Optional[dict]) -> bool:
  """The agent sent a turn's reply back as it got it: its text, and its calls' names and
  argument values (however the agent wrote them again, whatever ids it gave them); or
  its calls written into its text, in the template's format, with no `tool_calls` (what
  the built-in OpenAI agent and `jaxagent.blackbox.reply_text` hand the environment).
  Sent so, every reply with a call was encoded again from its text: forked, or its
  closing tokens left untrained, and a control string it spelled in bytes made live (a
  reviewer)."""
  if not isinstance(recorded, dict):
    return False
  content = sent.get("content") or ""
  if content == (recorded.get("content") or ""):
    calls = _calls(sent)
    return calls is not None and calls == _calls(recorded)
  if sent.get("tool_calls") or not recorded.get("tool_calls") or not isinstance(content, str):
    return False
  written = [(f.get("name"), f.get("arguments")) for c in recorded["tool_calls"]
             for f in [c.get("function") if isinstance(c, dict) else None]
             if isinstance(f, dict)]
  if all(isinstance(x, str) for pair in written for x in pair) and content == with_calls(
      recorded.get("content") or "", written):
    # (written back as the built-in agents and `reply_text` write it: so also a reply
    # with a malformed block, which the parse below reads as another; a reviewer)
    return True
  parsed = parse_tool_calls(content)
  # (its white space before kept, as `ChatTurn.finish` records the reply's: "\nHi" and a
  # call sent back so read as another reply; a reviewer)
  text = content[:len(content) - len(content.lstrip())] + parsed.content \
      if parsed.content else ""
  return (not parsed.errors and not parsed.unread
          and text == (recorded.get("content") or "")
          and [(c.name, _json_value(c.raw_arguments if c.raw_arguments is not None
                                    else json.dumps(c.arguments))) for c in parsed.calls]
          == _calls(recorded))


# Stands for an assistant's reply in a rendering, to find where the template closes it.
_REPLY = "\ue001reply\ue001"


def continued_prompt(tokenizer: Tokenizer, pieces: list, messages: list[dict],
                     tools: Optional[list[dict]], last: Optional[LastTurn]
                     ) -> Optional[list[int]]:
  """The prompt of a session's call that continues its last turn (`last`: the call's
  messages begin with that turn's, its tools are the turn's) as that turn's tokens and
  the rest of the rendering (`pieces` of `messages`): the tokens the model was given and
  sampled stay in its context as they were, not encoded again from their text.

  - The call's next message is the turn's reply (or a sibling's: a reply sampled from
    the same prompt, `LastTurn.replies`), sent back unchanged: the prompt and that
    reply's output ids, the template's end of an assistant turn, then the rest of the
    rendering (`Tokenizer.continue_turn`, as the white-box agent's `next_prompt`).
    Encoded again from its text, a reply that spelled a control string (`<|im_end|>` in
    bytes) came back as the live token, and one sampled in other tokens than the text's
    usual ones, or whose calls the template writes otherwise (spacing, text around them),
    was realigned or forked (red teams 23 and 24).
  - No more messages (a sibling of the turn: a retry, a best-of-n): the turn's prompt.
  - Another reply (the agent changed it): the turn's prompt, then the rest.
  None when the template does not render the history as a prefix of the call's rendering:
  the caller encodes the whole rendering."""
  if last is None:
    return None
  k = last.message_count
  if len(messages) == k:
    return list(last.prompt_ids)
  full = "".join(text for text, _ in pieces)
  head = tokenizer.render(messages[:k], tools, add_generation_prompt=True)
  if not full.startswith(head):
    return None
  reply = messages[k]
  same = [(out, response) for out, response in last.replies if _same_reply(reply, response)] \
      if reply.get("role") == "assistant" else []
  # (of siblings that read the same, the one whose call ids the agent sent back: by
  # value alone the newest, and a best-of-two's rejected reply, `{"x":1}` to the kept
  # `{"x": 1}`, was continued in place of the reply kept; a reviewer)
  ids = _call_ids(reply)
  kept = next((out for out, response in same if ids and _call_ids(response) == ids),
              same[0][0] if same else None)
  if kept is not None:
    closed = tokenizer.render(messages[:k + 1], tools, add_generation_prompt=False)
    marked = tokenizer.render(messages[:k] + [{"role": "assistant", "content": _REPLY}],
                              tools, add_generation_prompt=False)
    closing = marked[len(head) + len(_REPLY):]
    if (marked.startswith(head + _REPLY) and _REPLY not in closing and full.startswith(closed)
            and closed.endswith(closing)
            and closed[len(head):].startswith(reply.get("content") or "")):
      return tokenizer.continue_turn(last.prompt_ids, kept, closing, pieces,
                                     start=len(closed))
  return list(last.prompt_ids) + tokenizer.encode_pieces(pieces, start=len(head))


class TurnCut(Exception):
  """A turn the server could not finish: the engine failed (`status` 500) or the request
  was aborted other than by a weight update (`status` 503: the server stopping, an
  explicit abort). Never recorded, never shown as the model's answer: the agent must see
  an infrastructure failure, not a partial turn to be scored."""

  def __init__(self, status: int, message: str):
    super().__init__(message)
    self.status = status


# A turn that weight updates (`update_mode: abort`) cut is resumed for as long as its
# parts sample tokens (bounded by its max_tokens: a fixed count made a long turn, the
# policy's length, a cut turn, the infrastructure's; red team 17); after this many parts
# in a row that sampled nothing it ends as cut.
IDLE_RESUMES = 4


@dataclasses.dataclass
class ChatTurn:
  """One chat call in flight: its engine request and, once it ends, the assistant message
  parsed from the output (internal form: `content` and OpenAI-shaped `tool_calls`),
  recorded as a turn of the session (once) when first asked for.

  A weight update in abort mode cuts running requests; a chat turn so cut is resumed
  where it stopped, as a new request (`resubmit`) of its prompt and the tokens sampled so
  far, with the rest of its token budget and the same seed (as the white-box agent
  resumes its turns): the agent gets one whole turn, each token stamped with the
  version that sampled it. The parts are one turn everywhere (`output_ids`, the record).

  `messages` and `tools` are what was rendered into the prompt (internal form); `kind`
  names the gateway in the record; tool calls get ids `{id_prefix}_{request id}_{i}`.
  """

  req: Request  # the part running now (the last one)
  tokenizer: Tokenizer
  orch: Orchestrator
  _: dataclasses.KW_ONLY
  messages: list[dict]
  tools: Optional[list[dict]]
  sessions: SessionStore
  session_id: Optional[str]
  kind: str
  id_prefix: str
  resubmit: Optional[Callable[[list[int], Any, int], Request]] = None
  # Called when the turn is abandoned unfinished (its stream's client went away).
  on_abandoned: Optional[Callable[[], None]] = None
  _message: Optional[dict] = dataclasses.field(default=None, init=False, repr=False)
  # Where the turn was recorded (its session record's id, its index), once it was.
  recorded: Optional[tuple[str, int]] = dataclasses.field(default=None, init=False)
  abandoned: bool = dataclasses.field(default=False, init=False)  # (`abort_unfinished`)
  _parts: list = dataclasses.field(default_factory=list, init=False, repr=False)

  def __post_init__(self):
    self._parts = [self.req]

  # -- the turn across its parts -----------------------------------------------------------

  @property
  def request_id(self) -> str:
    return self._parts[0].request_id

  @property
  def prompt_ids(self) -> list[int]:
    return self._parts[0].prompt_ids

  def _joined(self, field: str) -> list:
    return [x for part in self._parts for x in getattr(part, field)]

  @property
  def output_ids(self) -> list[int]:
    return self._joined("output_ids")

  @property
  def output_logprobs(self) -> list[float]:
    return self._joined("output_logprobs")

  @property
  def versions(self) -> list[int]:
    return self._joined("versions")

  @property
  def finish_reason(self) -> Optional[str]:
    return self.req.finish_reason

  @property
  def max_new_tokens(self) -> int:
    """The turn's token budget, as asked for."""
    return self._parts[0].sampling.max_new_tokens

  def result(self) -> dict:
    """The record of the whole turn (as `Request.result`, over every part)."""
    out = self._parts[0].result()
    for field in ("output_ids", "output_logprobs", "raw_logprobs", "versions"):
      out[field] = self._joined(field)
    out.update(finish_reason=self.req.finish_reason, error=self.req.error,
               resumed=len(self._parts) - 1,
               decode_s=sum(part.decode_s for part in self._parts),
               part_ids=[part.request_id for part in self._parts])
    return out

  def _resume(self) -> bool:
    """Submits the next part if a weight update cut the running one; False if it ended."""
    req, first = self.req, self._parts[0]
    done = len(self.output_ids)
    idle = 0  # the parts at the end that sampled nothing
    for part in reversed(self._parts[1:]):
      if part.output_ids:
        break
      idle += 1
    if not (req.finish_reason == "abort" and req.abort_cause == "weight_update"
            and self.resubmit is not None and idle < IDLE_RESUMES
            and done < first.sampling.max_new_tokens):
      return False
    # (the seed as it was: the engine keys a token by its position in the sequence, so a
    # part goes on as the uncut turn would have; moved on by `done`, it took another
    # request's keys, a sibling's of consecutive seeds: red team 113)
    sampling = dataclasses.replace(first.sampling,
                                   max_new_tokens=first.sampling.max_new_tokens - done)
    try:
      self.req = self.resubmit(list(first.prompt_ids) + self.output_ids, sampling, done)
    except Exception as e:  # refused (the prompt with the cut turn is too long, a full
      # queue): the update's doing, never the policy's; the turn is cut
      detail = getattr(e, "detail", None) or e
      raise TurnCut(503, f"a turn cut by a weight update could not be resumed: {detail}"
                    ) from None
    self._parts.append(self.req)
    return True

  async def complete(self, wait: Callable[[Request], Awaitable[None]]) -> None:
    """Awaits the turn's end (`wait` awaits one request), resuming it across updates;
    `TurnCut` when a resume is refused."""
    await wait(self.req)
    while self._resume():
      await wait(self.req)

  def finish(self) -> dict:
    """The assistant message of the finished turn; records the turn the first time.
    Raises `TurnCut` for a turn the server could not finish."""
    if self._message is not None:
      return self._message
    req = self.req
    if not req.done:  # its client went away (the request is being aborted): no record
      raise TurnCut(503, "the turn did not end: its client went away")
    if req.finish_reason == "error":
      raise TurnCut(500, f"the engine failed during this turn: {req.error}")
    if req.finish_reason == "abort":
      raise TurnCut(503, "the turn was aborted before it ended (the server stopping, an "
                         f"explicit abort, or weight updates that cut it {IDLE_RESUMES} times "
                         "in a row before it sampled a token)")
    ids = self.output_ids
    if ids and ids[-1] in self.tokenizer.stop_ids:
      ids = ids[:-1]
    text = self.tokenizer.decode(ids)
    parsed = parse_tool_calls(text, id_prefix=f"{self.id_prefix}_{self.request_id}")
    # (a malformed call stays in the content as written: the agent hands it to its
    # environment, which tells the policy and counts it, as for a white-box agent)
    content = text if not parsed.calls else parsed.kept if parsed.errors else parsed.content
    if parsed.calls and not parsed.errors and content:
      # (the white space before it kept, as a stream sent it: stripped, the reply no
      # longer began with what the stream had sent, a reviewer of red team 23)
      content = text[:len(text) - len(text.lstrip())] + content
    if parsed.calls and not hands_out_whole(parsed, content):  # (the calls, taken out,
      # would make others: the text as sampled, which the environment parses itself)
      parsed, content = dataclasses.replace(parsed, calls=[]), text
    message = {"role": "assistant", "content": content}
    if parsed.calls:
      message["tool_calls"] = [c.openai() for c in parsed.calls]
    if self.session_id:
      record = self.result()
      record.update(kind=self.kind, messages=self.messages, tools=self.tools, response=message,
                    tool_call_errors=parsed.errors)
      self.recorded = self.sessions.record(self.session_id, record)
    self._message = message
    return message

  def visible_text(self) -> str:
    """The text sampled so far that a stream may show: up to the first tool-call marker,
    less a trailing incomplete UTF-8 character (U+FFFD), stop tokens and an end that may
    yet become the marker (`<`, `<tool`, ...: sent, it could not be taken back, and a
    call's tag came out as text beside the call, a new user's finding)."""
    ids = [t for t in self.output_ids if t not in self.tokenizer.stop_ids]
    text = self.tokenizer.decode(ids)
    cut = text.find(OPEN)
    if cut < 0:
      cut = next((len(text) - n for n in range(min(len(OPEN) - 1, len(text)), 0, -1)
                  if text.endswith(OPEN[:n])), len(text))
    return text[:cut].rstrip("\ufffd")

  async def text_deltas(self) -> AsyncIterator[str]:
    """What a stream may show of the answer's text, piece by piece as tokens arrive
    (`visible_text`; trailing white space is held back: before a tool call the answer's
    text drops it); `TurnCut` when a resume is refused."""
    sent = ""
    async for _ in self.progress():
      visible = self.visible_text().rstrip()
      if len(visible) > len(sent) and visible.startswith(sent):
        yield visible[len(sent):]
        sent = visible

  async def progress(self) -> AsyncIterator[None]:
    """Yields after each batch of new tokens, until the turn ends (across resumes);
    `TurnCut` when a resume is refused."""
    loop = asyncio.get_running_loop()
    while True:
      req, queue = self.req, asyncio.Queue()
      req.add_listener(lambda r, n: loop.call_soon_threadsafe(queue.put_nowait, n))
      while not req.done:
        await queue.get()
        yield
      if not self._resume():
        return

  def abort_unfinished(self) -> None:
    """Frees the request's slot if it is still running (its stream's client went away);
    once (the stream's end and its response's both call it)."""
    if not self.req.done and not self.abandoned:
      self.abandoned = True
      self.orch.abort(self.req.request_id)
      if self.on_abandoned is not None:
        self.on_abandoned()


def openai_error(status: int, message: str, param: Optional[str] = None) -> dict:
  """OpenAI's error shape (what its client reads into `e.message`, `e.param`, `e.type`)."""
  kind = ("invalid_request_error" if status in (400, 404, 422) else
          "server_overloaded" if status == 503 else "api_error")
  return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _maybe_not_finite(body: bytes) -> bool:
  """Whether a JSON body may hold a NaN, an Infinity or a number past a float's range: it
  holds NaN or Infinity, an exponent of three digits or more after a digit, or 200 digits
  in a row (a number of at most 209 whole digits and a two-digit exponent is under
  10^308; 300, as before, let 1.8e308 written as 18 and 208 zeros then e99 through: a
  reviewer). In numpy: a regular expression took 1.9 s over 46 MB of short items, the
  event loop held (red team 116)."""
  if b"NaN" in body or b"Infinity" in body:
    return True
  text = np.frombuffer(body, np.uint8)
  digit = np.zeros(text.size + 5, bool)  # (padded: a run of digits ends before the end)
  digit[:text.size] = (text >= ord("0")) & (text <= ord("9"))
  e = np.flatnonzero((text[1:] | 32) == ord("e")) + 1  # (e or E)
  e = e[digit[e - 1]]
  if e.size:
    first = e + 1 + (text[np.minimum(e + 1, text.size - 1)] == ord("+"))
    if (digit[first] & digit[first + 1] & digit[first + 2]).any():
      return True
  starts = np.flatnonzero(digit[1:] & ~digit[:-1]) + 1  # (where a run of digits begins)
  if digit[0]:
    starts = np.insert(starts, 0, 0)
  ends = np.flatnonzero(digit[:-1] & ~digit[1:]) + 1
  return bool((ends - starts >= 200).any())


def finite_json(body: bytes) -> None:
  """ValueError naming a NaN, an Infinity or a number past a float's range in a JSON body
  (Python's json reads them, FastAPI passed them on: recorded in a session, its record
  could not be written out again, a 400 on every read, red team 24). A body that is not
  JSON is left to the route to name."""
  if not body or not _maybe_not_finite(body):  # (the usual body: parsed once)
    return
  try:
    json.loads(body, **FINITE_JSON)
  except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
    return
  except ValueError as e:
    raise ValueError(f"body: {e}") from None


class ShapedErrorsRoute(DepthBoundRoute):
  """A route whose errors take its API's shape (`error(status, message, field)`): a body
  that breaks the schema gets a 422 naming the field, a request that cannot be served
  (a body nested too deep among them) a 400, a full queue a 503."""

  @staticmethod
  def error(status: int, message: str, field: Optional[str]) -> dict:
    raise NotImplementedError

  def get_route_handler(self):
    handler = super().get_route_handler()

    async def shaped(request):
      try:
        finite_json(await request.body())
        return await handler(request)
      except RequestValidationError as e:
        bad = invalid_json(e.errors())  # (a 400, as OpenAI answers it)
        if bad is not None:
          return JSONResponse(self.error(400, bad, "body"), status_code=400)
        where = [(".".join(map(str, err["loc"][1:])) or "body", err["msg"])
                 for err in e.errors()]
        message = "; ".join(f"{field}: {msg}" for field, msg in where)
        unread = not_json(request, e.errors())
        if unread is not None:
          message, where = unread, [("body", "")]
        return JSONResponse(self.error(422, message, where[0][0] if where else None),
                            status_code=422)
      except HTTPException as e:
        message, field = str(e.detail), None
        if isinstance(e.__cause__, RecursionError):  # (FastAPI said "error parsing the body")
          message, field = NESTED_TOO_DEEP, "body"
        elif (said := unreadable_body(e)) is not None:  # (not UTF-8, an integer too long)
          message, field = said, "body"
        return JSONResponse(self.error(e.status_code, message, field),
                            status_code=e.status_code)
      except ValueError as e:
        return JSONResponse(self.error(400, str(e), None), status_code=400)

    return shaped


class OpenAIRoute(ShapedErrorsRoute):
  """OpenAI's error shape (FastAPI's list of details read as 'Error code: 422' alone in
  the `openai` client)."""

  @staticmethod
  def error(status: int, message: str, field: Optional[str]) -> dict:
    return openai_error(status, message, field)
