"""OpenAI's Responses API on the rollout server (`POST /v1/responses`).

What agent frameworks written against OpenAI's newer API send (the `openai-agents` SDK,
`client.responses.create`): a list of input items (messages, `function_call` items as
the model made them, `function_call_output` items answering them), `instructions`, and
function tools; or `previous_response_id`, the conversation of a response this server
made and kept, continued. The items are converted to the internal chat form
(OpenAI's chat message dicts: a reply's message and function calls become one assistant
message with `tool_calls`, each output a `tool` message), so the same chat renders to the
same tokens through every gateway and is recorded in the same session; the answer goes
back as output items (`message` with `output_text`, `function_call`), or as the API's
server-sent events.

Refused, naming the field: hosted tools (web search, file search, computer use, MCP,
...: only `function` tools are served), a `tool_choice` other than `auto`,
`parallel_tool_calls: false`, reasoning (`reasoning` with an effort other than `none` or
a summary, `reasoning` items in the input: the policy writes no hidden reasoning),
`item_reference` items and `conversation` (nothing is kept but the responses
themselves), `context_management`, `background`, `prompt` templates, `truncation: auto`
(dropping items would change the prompt unseen), a text format other than plain text,
content parts other than text (images, files, audio, refusals), and `chat.UNSERVED`'s
fields. `temperature`, `top_p`, `top_k` and `seed` sample as on the chat route (the last
two are not OpenAI's: send them as extra body fields).

Responses are kept (unless `store: false`) for `previous_response_id`, in memory, the
newest first within `ResponseStore`'s bound. A router keeps its own record of those it
relayed (`RelayedResponses`): a chain's calls reach the server that keeps it, or, that
server down, another with the chain's items as their input.
"""

from __future__ import annotations

import collections
import itertools
import json
from typing import Any, AsyncIterator, Callable, Literal, NamedTuple, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollout_server.chat import SEED, TOP_K, ChatTurn, Name, TurnCut, call_arguments, unserved
from rollout_server.sessions import held_bytes

# -- request bodies -----------------------------------------------------------------------


class ResponsesBody(BaseModel):
  # Unknown fields (metadata, user, prompt_cache_key, service_tier, ...) are accepted and
  # ignored, as on the other routes; those that would change the answer are refused.
  model_config = ConfigDict(extra="allow", strict=True)
  model: Optional[Name] = None
  input: Union[str, list[Any]]
  instructions: Optional[str] = None
  previous_response_id: Optional[Name] = None
  tools: Optional[list[Any]] = None
  tool_choice: Optional[Union[str, dict]] = None
  parallel_tool_calls: Optional[bool] = None
  max_output_tokens: Optional[int] = Field(None, ge=1)
  # (OpenAI's clients may send null for "the default")
  temperature: Optional[float] = Field(None, ge=0.0, le=100.0)
  top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
  top_k: int = TOP_K
  seed: Optional[int] = SEED
  stream: bool = False
  store: Optional[bool] = None
  include: Optional[list[str]] = None
  top_logprobs: Optional[int] = None
  reasoning: Optional[dict] = None
  text: Optional[dict] = None
  truncation: Optional[str] = None
  conversation: Optional[Any] = None
  background: Optional[bool] = None
  prompt: Optional[Any] = None
  metadata: Optional[dict] = None

  @property
  def logprobs(self) -> bool:
    """Each output token's log-prob asked for (`include`)."""
    return "message.output_text.logprobs" in (self.include or ())


class _Item(BaseModel):
  # (an item's id and status, and what else it carries, change nothing here)
  model_config = ConfigDict(extra="ignore")


class TextPart(_Item):
  type: Literal["input_text", "output_text", "text"]
  text: str


class MessageItem(_Item):
  type: Literal["message"] = "message"
  role: Literal["user", "assistant", "system", "developer"]
  content: Union[str, list[dict]]


# A call's id is not in the prompt, so nothing else bounds it (1.5 MB ids made each call
# of a few tokens 3 MB in a router's record, and its made-whole calls 37 MB: red team 41).
CALL_ID = Field(min_length=1, max_length=256)


class FunctionCallItem(_Item):
  type: Literal["function_call"]
  call_id: Name = CALL_ID
  name: str = Field(min_length=1)
  arguments: str


class FunctionCallOutputItem(_Item):
  type: Literal["function_call_output"]
  call_id: Name = CALL_ID
  output: Union[str, list[dict]]


class FunctionTool(_Item):
  type: Literal["function"]
  name: str = Field(min_length=1)
  description: Optional[str] = None
  parameters: Optional[dict] = None
  strict: Optional[bool] = None


def _items_of(given: Any) -> Any:
  """A call's input as items (a string is one user message)."""
  return [{"role": "user", "content": given}] if isinstance(given, str) else given


def _reply_of(call_id: str) -> Optional[str]:
  """The reply a call id this server gave belongs to (`call_{request id}_{i}`), or None."""
  head, _, index = call_id.rpartition("_")
  return head if head.startswith("call_") and index.isdigit() else None


_ITEMS = {"message": MessageItem, "function_call": FunctionCallItem,
          "function_call_output": FunctionCallOutputItem}


def _parsed(model: type[BaseModel], value: Any, where: str) -> Any:
  try:
    return model.model_validate(value)
  except ValidationError as e:
    err = e.errors()[0]
    field = ".".join(map(str, err["loc"]))
    raise ValueError(f"{where}{'.' + field if field else ''}: {err['msg']}") from None


def _text(content: Union[str, list], where: str, parts: tuple[str, ...]) -> str:
  """A content's text: a string, or its text parts (of the kinds in `parts`) joined."""
  if isinstance(content, str):
    return content
  texts = []
  for j, p in enumerate(content):
    kind = p.get("type") if isinstance(p, dict) else type(p).__name__
    if kind not in parts:
      raise ValueError(f"{where}[{j}]: only text parts ({' or '.join(parts)}) are served, "
                       f"got {kind!r}")
    texts.append(_parsed(TextPart, p, f"{where}[{j}]").text)
  return "".join(texts)


def _function_schema(tool: Any, where: str) -> dict:
  kind = tool.get("type") if isinstance(tool, dict) else None
  if kind != "function":
    raise ValueError(f"{where}: only function tools are served, got type {kind!r} (hosted "
                     "tools, web or file search, computer use, MCP, are OpenAI's own)")
  tool = _parsed(FunctionTool, tool, where)
  function: dict = {"name": tool.name}
  if tool.description is not None:
    function["description"] = tool.description
  if tool.parameters is not None:
    function["parameters"] = tool.parameters
  return {"type": "function", "function": function}


def refused(body: ResponsesBody) -> Optional[str]:
  """Why the request cannot be served as asked (a field that would change what is
  sampled, or state this server does not keep), or None."""
  why = unserved(body.model_extra)
  if why is not None:
    return why
  if body.tool_choice not in (None, "auto"):
    return (f"tool_choice: only auto is served, got {json.dumps(body.tool_choice)[:100]} "
            "(sampling cannot be made to call, or not call, a tool)")
  if body.parallel_tool_calls is False:
    return ("parallel_tool_calls: false is not served (sampling cannot be held to one call; "
            "an answer may hold several)")
  if body.reasoning and any(v is not None and not (k == "effort" and v == "none")
                            for k, v in body.reasoning.items()):
    return ("reasoning: not served (the policy writes no hidden reasoning; its whole output "
            "is the answer), got " + json.dumps(body.reasoning)[:100])
  if body.top_logprobs:
    return ("top_logprobs: not served (include message.output_text.logprobs gives each "
            "sampled token's log-prob)")
  text_format = (body.text or {}).get("format")
  if text_format not in (None, {"type": "text"}):
    return (f"text.format: only plain text is served, got {json.dumps(text_format)[:100]} "
            "(a schema would constrain the sampling)")
  if body.truncation not in (None, "disabled"):
    return (f"truncation: only disabled is served, got {body.truncation!r} (items dropped "
            "from the context would change the prompt unseen)")
  if (body.model_extra or {}).get("context_management") is not None:
    return ("context_management: not served (the context is not compacted here: an agent "
            "compacts its own, or the conversation ends at the model's context)")
  if body.conversation is not None:
    return ("conversation: not served (conversations are not kept here): send the items, "
            "or previous_response_id")
  if body.background:
    return "background: not served (a response is answered in its request)"
  if body.prompt is not None:
    return "prompt: prompt templates are not served (send the input items)"
  return None


def chat_messages(body: ResponsesBody, prior: list[dict] = (),
                  parts: Optional[list[int]] = None
                  ) -> tuple[list[dict], list[dict], Optional[list[dict]]]:
  """The request in the internal chat form: (messages, the conversation to keep for the
  response: `prior` and the input's, without the instructions, tool schemas).

  `prior`: the conversation of `previous_response_id` (internal form). Consecutive
  assistant items (a reply's message and its function calls) are one assistant message;
  a `function_call_output` must answer a call of the assistant message before. `parts`:
  the input's items in parts (their counts), each read as a call's input after the
  conversation before it (the chain of a router's made-whole call: each response's input,
  then its output), so that no item joins the part before. ValueError names what cannot
  be served."""
  why = refused(body)
  if why is not None:
    raise ValueError(why)
  kept, start = [dict(m) for m in prior], len(prior)
  items = _items_of(body.input)
  begins = set(itertools.accumulate((parts or [])[:-1]))  # (where a part after the first does)
  if not items and not kept:
    raise ValueError("input: empty (give at least one item, or previous_response_id)")

  # The open reply (the last assistant message when only its calls' outputs follow it),
  # its calls' ids and threads and the ids answered since, kept as items are read (worked
  # out anew for each item, N calls and their N outputs took seconds: red team 116).
  reply_at: Optional[int] = None
  made: set = set()
  threads: set = set()
  answered: set = set()
  own_calls: set = set()  # (the messages whose tool_calls list is this call's to extend)

  def opened(at: Optional[int]) -> None:
    nonlocal reply_at, made, threads, answered
    reply_at = at
    calls = kept[at].get("tool_calls") or [] if at is not None else []
    made = {c["id"] for c in calls}
    threads = {_reply_of(c["id"]) for c in calls} - {None}
    answered = ({m.get("tool_call_id") for m in kept[at + 1:]} if at is not None else set())

  def add_call(at: int, call: dict) -> None:
    if at not in own_calls:  # (a prior message's list is the kept conversation's)
      kept[at]["tool_calls"] = list(kept[at].get("tool_calls") or [])
      own_calls.add(at)
    kept[at]["tool_calls"].append(call)
    made.add(call["id"])
    threads.add(_reply_of(call["id"]))

  for j in range(len(kept) - 1, -1, -1):
    if kept[j]["role"] != "tool":
      opened(j if kept[j]["role"] == "assistant" else None)
      break

  for i, raw in enumerate(items):
    where = f"input[{i}]"
    if i in begins:
      start = len(kept)
    kind = raw.get("type", "message") if isinstance(raw, dict) else None
    if kind not in _ITEMS:
      why = {"reasoning": " (the policy writes no hidden reasoning: send the items of "
                          "this server's responses)",
             "item_reference": " (items are not kept here: send the items themselves)"
             }.get(kind, " (only message, function_call and function_call_output items "
                         "are served)")
      raise ValueError(f"{where}: an item of type {kind!r} is not served{why}"
                       if kind is not None else f"{where}: not an item (an object)")
    item = _parsed(_ITEMS[kind], raw, where)
    last = kept[-1] if len(kept) > start else None  # (the answer continued stays as it was)
    if isinstance(item, FunctionCallItem):
      # (named by its item here: the chat form's check names a message and call)
      if call_arguments(item.arguments) is None:
        raise ValueError(f"{where}.arguments must be the JSON text of an object, got "
                         f"{item.arguments!r:.100}")
      call = {"id": item.call_id, "type": "function",
              "function": {"name": item.name, "arguments": item.arguments}}
      if last is not None and last["role"] == "assistant":
        add_call(len(kept) - 1, call)  # (the open reply: nothing follows it)
      elif (reply_at is not None and reply_at >= start
            and _reply_of(item.call_id) is not None and _reply_of(item.call_id) in threads):
        # A call of the reply whose outputs came between its calls ([call 1, output 1,
        # call 2, output 2], as OpenAI's guide writes them): its reply's, told by the call
        # ids this server gave (as separate turns, the reply was encoded anew: a fork)
        add_call(reply_at, call)
      else:
        kept.append({"role": "assistant", "content": "", "tool_calls": [call]})
        own_calls.add(len(kept) - 1)
        opened(len(kept) - 1)
    elif isinstance(item, FunctionCallOutputItem):
      if item.call_id not in made or item.call_id in answered:
        why = ("which has its output already" if item.call_id in made else
               "which the assistant message before did not make (" + (
                   f"it called {', '.join(sorted(map(repr, made)))}" if made else
                   "a message came between them" if reply_at is None and any(
                       m["role"] == "assistant" for m in kept) else
                   "it called no function") + ")")
        raise ValueError(f"{where}: function_call_output for call_id {item.call_id!r}, {why}")
      kept.append({"role": "tool", "tool_call_id": item.call_id,
                   "content": _text(item.output, f"{where}.output", ("input_text",))})
      answered.add(item.call_id)
    elif item.role == "assistant":
      # (a message item starts a reply: one of ours has at most one, before its calls)
      kept.append({"role": "assistant", "content": _text(
          item.content, f"{where}.content", ("output_text", "input_text"))})
      opened(len(kept) - 1)
    else:
      role = "user" if item.role == "user" else "system"
      kept.append({"role": role, "content": _text(item.content, f"{where}.content",
                                                   ("input_text",))})
      opened(None)
  if kept[-1]["role"] == "assistant":
    raise ValueError(f"input[{len(items) - 1}]: the last item must not be the assistant's "
                     "(continuing an assistant's text is not supported)" if items else
                     "input: empty (the conversation of previous_response_id ends with its "
                     "answer: give the next items)")
  tools = [_function_schema(t, f"tools[{j}]") for j, t in enumerate(body.tools or [])] or None
  system = [{"role": "system", "content": body.instructions}] if body.instructions else []
  return system + kept, kept, tools


# -- kept responses (previous_response_id) --------------------------------------------------


class _Kept(NamedTuple):
  parent: Optional[str]  # the response it continued
  nbytes: int
  value: Any  # what is kept of it


class _Chains:
  """Responses by id, each with the response it continued (a chain of n calls keeps n
  steps, not n conversations), its size and what is kept of it; the least recently used
  go first past `max_bytes` (a chain's call uses every response before it: `_chain` and
  `_used` make them all the most recently used)."""

  def __init__(self, max_bytes: int):
    self.max_bytes = max_bytes
    self.bytes = 0
    self._kept: collections.OrderedDict[str, _Kept] = collections.OrderedDict()

  def __len__(self) -> int:
    return len(self._kept)

  def _put(self, response_id: str, parent: Optional[str], value: Any, nbytes: int) -> None:
    if response_id in self._kept:
      self.bytes -= self._kept.pop(response_id).nbytes
    self._kept[response_id] = _Kept(parent, nbytes, value)
    self.bytes += nbytes
    while self.bytes > self.max_bytes and len(self._kept) > 1:
      self.bytes -= self._kept.popitem(last=False)[1].nbytes

  def _chain(self, response_id: str) -> list:
    """What is kept of the response's chain, oldest first; KeyError(the response of it
    not kept) when one has gone."""
    steps, at = [], response_id
    while at is not None:
      if at not in self._kept:
        raise KeyError(at)
      steps.append(at)
      at = self._kept[at].parent
    for at in reversed(steps):  # (the newest most recently used: evicted last)
      self._kept.move_to_end(at)
    return [self._kept[at].value for at in reversed(steps)]

  def _used(self, response_id: Optional[str]) -> bool:
    """Makes the response's chain the most recently used; whether all of it is kept."""
    try:
      return response_id is not None and bool(self._chain(response_id))
    except KeyError:
      return False


class ResponseStore(_Chains):
  """Responses kept for `previous_response_id`: each the messages it added to its
  conversation (its input's and its answer) and the session turn it was recorded as; a
  chain whose earlier response has gone is said to be gone."""

  def __init__(self, max_bytes: int = 64 << 20):
    super().__init__(max_bytes)

  def conversation(self, response_id: str) -> list[dict]:
    """The conversation a response ended (its instructions left out); KeyError naming
    why when it is not kept."""
    try:
      steps = self._chain(response_id)
    except KeyError as e:
      at = e.args[0]
      raise KeyError(
          f"previous_response_id: {response_id!r} is not kept on this server" + (
              "" if at == response_id else f" (the response {at!r} it continued has gone)")
          + ": responses are kept in memory by the server that made them, the newest "
            "within its bound, unless made with store: false (a router sends a chain's "
            "calls to the server that keeps it); send the whole input") from None
    return [m for added, _ in steps for m in added]

  def keep(self, response_id: str, parent: Optional[str], added: list[dict],
           turn: Optional[tuple[str, str, int]] = None) -> None:
    """`turn`: the session turn it was recorded as (session id, record id, index)."""
    self._put(response_id, parent, (added, turn), held_bytes(added) + 300)

  def turn_of(self, response_id: str) -> Optional[tuple[str, str, int]]:
    """The session turn the response was recorded as, when it was and is kept."""
    kept = self._kept.get(response_id)
    return None if kept is None else kept.value[1]


def _compact(items: list) -> bytes:
  """Items as compact JSON, with only the fields a conversation is made of (their ids,
  status, log-probs and whatever else a client added left out: a router's record is
  bounded by these bytes)."""
  def part(p: Any) -> Any:
    return {k: p[k] for k in ("type", "text") if k in p} if isinstance(p, dict) else p

  def item(x: Any) -> Any:
    if not isinstance(x, dict):
      return x
    kind = x.get("type", "message")
    keep = {"message": ("type", "role", "content"),
            "function_call": ("type", "call_id", "name", "arguments"),
            "function_call_output": ("type", "call_id", "output")}.get(kind)
    if keep is None:
      return x
    out = {k: x[k] for k in keep if k in x}
    for k in ("content", "output"):
      if isinstance(out.get(k), list):
        out[k] = [part(p) for p in out[k]]
    return out

  return json.dumps([item(x) for x in items], separators=(",", ":")).encode()


class RelayedResponses(_Chains):
  """A router's record of the responses it relayed (kept where they were made): the
  backend that made and keeps each, the response it continued, and what it added to its
  conversation in the API's own items (its input's, then its output's; compact JSON). A
  call continuing a response goes to that backend; when it is down, or has lost it, the
  call goes with the chain's items as its input (`whole`). A chain in use is the most
  recently used, all of it (the router's record dropped a live chain's first responses
  before idle ones, so the chain could not be made whole when its home died: a
  reviewer)."""

  def __init__(self, max_bytes: int = 64 << 20):
    super().__init__(max_bytes)

  def home(self, response_id: str) -> tuple[Optional[str], bool]:
    """(The backend that made the response, or None when this router did not relay it;
    whether its whole chain is here to be made whole). The chain is used."""
    kept = self._kept.get(response_id)
    return (None, False) if kept is None else (kept.value[0], self._used(response_id))

  @staticmethod
  def step(request: Any) -> Optional[tuple[Optional[str], bytes]]:
    """What a call adds to its chain, taken from its body when it is sent (its body's
    parse need not live as long as the call): (the response it continues, its input items
    compact); None when the body is no call. (Whether the response is kept where it was
    made is the response's own `store`, as the server read the call's: `learn`.)"""
    if not isinstance(request, dict):
      return None
    items, parent = _items_of(request.get("input")), request.get("previous_response_id")
    if not isinstance(items, list) or not (parent is None or isinstance(parent, str)):
      return None
    return parent, _compact(items)

  def learn(self, backend: str, step: Optional[tuple], response: Any) -> None:
    """Keeps a relayed response (`step`: its call's, `response`: its body); nothing when
    it was not kept where it was made, or is not what a served response is."""
    if not (step is not None and isinstance(response, dict)
            and isinstance(response.get("id"), str) and response.get("store") is not False
            and isinstance(response.get("output"), list)):
      return
    out = []
    for item in response["output"]:  # (as input items)
      if not isinstance(item, dict):
        return
      if item.get("type") == "message":
        out.append({"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": p.get("text", "")}
            for p in item.get("content") or [] if isinstance(p, dict)]})
      elif item.get("type") == "function_call":
        out.append(item)
    parent, given = step
    made = _compact(out)
    self._used(parent)  # (its chain is in use: all of it the most recently used)
    self._put(response["id"], parent, (backend, given, made), len(given) + len(made) + 300)

  def whole(self, request: Any) -> Optional[dict]:
    """The call continuing a response, made whole for a backend that does not keep it:
    the chain's items, then its own, as its input, and `jaxagent_made_whole` saying where
    each response's input and output items begin (the server reads them as it reads a
    kept conversation: `chat_messages`' `parts`) and the response it continues (echoed);
    None when the body is no such call or a response of the chain is not here (evicted,
    or relayed by another router)."""
    continued = request.get("previous_response_id") if isinstance(request, dict) else None
    if not (isinstance(continued, str) and isinstance(request.get("input"), (str, list))):
      return None
    try:
      steps = self._chain(continued)
    except KeyError:
      return None
    own = _items_of(request["input"])
    items, parts = [], []
    for _, *kept in steps:  # (each response's input items, then its output items)
      for part in map(json.loads, kept):
        items += part
        parts.append(len(part))
    body = {k: v for k, v in request.items() if k != "previous_response_id"}
    body[MADE_WHOLE] = {"previous_response_id": continued,
                                   "parts": parts + [len(own)]}
    return {**body, "input": items + own}


class StreamEnd:
  """Reads a relayed stream of Responses events for its last one's response (`response`:
  that of `response.completed` or `response.incomplete`, else None), holding only the
  event in progress, up to `limit` bytes (one past it is not read). Each chunk is
  searched once: the whole event in progress, searched again at every chunk, took 4 s
  of the router's loop for an 8 MB response in 16 KB chunks."""

  _LAST = (b"event: response.completed", b"event: response.incomplete")

  def __init__(self, limit: int = 256 << 20):
    self.response: Optional[dict] = None
    self.limit = limit
    self._pending = bytearray()
    self._seen = 0  # (how much of `_pending` holds no event's end)
    self._over = False  # (the event in progress is past `limit`: dropped, not read)

  def feed(self, chunk: bytes) -> None:
    self._pending += chunk
    while True:
      start = max(self._seen - 3, 0)  # (an end cut between chunks)
      ends = [(i, len(sep)) for sep in (b"\n\n", b"\r\n\r\n")
              if (i := self._pending.find(sep, start)) >= 0]
      if not ends:
        self._seen = len(self._pending)
        if len(self._pending) > self.limit:
          self._over = True
          del self._pending[:-3]
          self._seen = len(self._pending)
        return
      i, n = min(ends)
      event, over = bytes(self._pending[:i]), self._over
      del self._pending[:i + n]
      self._seen, self._over = 0, False
      if not over:
        self._read(event.replace(b"\r\n", b"\n"))

  def _read(self, event: bytes) -> None:
    if event.startswith(self._LAST):
      data = b"".join(line[len(b"data:"):] for line in event.split(b"\n")
                      if line.startswith(b"data:"))
      try:
        self.response = json.loads(data).get("response")
      except (ValueError, AttributeError, RecursionError):
        self.response = None


# -- answers --------------------------------------------------------------------------------


MADE_WHOLE = "jaxagent_made_whole"


def made_whole(body: ResponsesBody) -> tuple[Optional[str], Optional[list[int]]]:
  """A router's call made whole (`RelayedResponses.whole`): (the response it continues,
  which the answer echoes; its input's parts, `chat_messages`'); (None, None) for any
  other call. ValueError when its field is not one. (A router refuses the field from
  its clients; a client calling a server itself can set no more with it than what items
  join which response's and the id echoed.)"""
  given = (body.model_extra or {}).get(MADE_WHOLE)
  if given is None:
    return None, None
  parts = given.get("parts") if isinstance(given, dict) else None
  count = len(body.input) if isinstance(body.input, list) else 1
  if body.previous_response_id is not None or not (
      isinstance(given, dict) and isinstance(given.get("previous_response_id"), str)
      and isinstance(parts, list)
      and all(type(p) is int and p >= 0 for p in parts) and sum(parts) == count):
    raise ValueError(
        "jaxagent_made_whole: not a router's call made whole (an object with "
        "previous_response_id, the response continued, and parts, the counts of the input's "
        "items of each response and of the call, without a previous_response_id of its own)")
  return given["previous_response_id"], parts


def echo(body: ResponsesBody, model: str, continued: Optional[str] = None) -> dict:
  """The request's settings, as a response object repeats them (`continued`: the response
  a call made whole continued)."""
  return {"model": model, "instructions": body.instructions,
          "tools": list(body.tools or []), "tool_choice": "auto",
          "parallel_tool_calls": True,
          "temperature": 1.0 if body.temperature is None else body.temperature,
          "top_p": 1.0 if body.top_p is None else body.top_p,
          "max_output_tokens": body.max_output_tokens,
          "previous_response_id": body.previous_response_id or continued,
          "store": body.store is not False, "metadata": body.metadata or {},
          "text": {"format": {"type": "text"}}, "truncation": "disabled",
          "reasoning": {"effort": None, "summary": None}, "user": body.model_extra.get("user")
          if body.model_extra else None}


def _message_item(turn: ChatTurn, text: str, status: str, logprobs: list) -> dict:
  return {"id": f"msg_{turn.request_id}", "type": "message", "status": status,
          "role": "assistant",
          "content": [{"type": "output_text", "text": text, "annotations": [],
                       "logprobs": logprobs}]}


def output_items(turn: ChatTurn, logprobs: bool = False) -> list[dict]:
  """The finished turn's answer as output items: a `message` (when it has text, or no
  calls), then a `function_call` a call."""
  message = turn.finish()
  calls = message.get("tool_calls") or []
  items = []
  if message["content"] or not calls:
    items.append(_message_item(turn, message["content"], _status(turn),
                               token_logprobs(turn) if logprobs else []))
  for i, c in enumerate(calls):
    items.append({"id": f"fc_{turn.request_id}_{i}", "type": "function_call",
                  "status": "completed", "call_id": c["id"], "name": c["function"]["name"],
                  "arguments": c["function"]["arguments"]})
  return items


def token_logprobs(turn: ChatTurn) -> list[dict]:
  """Each sampled token's log-prob (the whole output's, tool calls' tokens too, as the
  chat route's `logprobs`)."""
  out = []
  for t, lp in zip(turn.output_ids, turn.output_logprobs):
    out.append({"token": turn.tokenizer.decode([t]), "logprob": lp,
                "bytes": list(turn.tokenizer.token_bytes(t)), "top_logprobs": []})
  return out


def _status(turn: ChatTurn) -> str:
  return "incomplete" if turn.finish_reason == "length" else "completed"


def incomplete_details(turn: ChatTurn) -> Optional[dict]:
  """Why a response is incomplete: its max_output_tokens, or the context's end before
  them (`context_window_exceeded`, not one of OpenAI's reasons: an agent must tell a
  conversation that outgrew the model from its own budget, red team 24)."""
  if turn.finish_reason != "length":
    return None
  budget = len(turn.output_ids) >= turn.max_new_tokens
  return {"reason": "max_output_tokens" if budget else "context_window_exceeded"}


def usage(turn: ChatTurn) -> dict:
  prompt, out = len(turn.prompt_ids), len(turn.output_ids)
  return {"input_tokens": prompt,
          "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
          "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
          "total_tokens": prompt + out}


def response_body(turn: ChatTurn, settings: dict, created: int, *,
                  output: Optional[list[dict]] = None, status: Optional[str] = None,
                  error: Optional[dict] = None, logprobs: bool = False) -> dict:
  """A response object: the finished turn's (its output items, usage and the token ids,
  log-probs and versions the engine sampled, under `jaxagent`), or one in progress or
  failed (`output`, `status`, `error` given)."""
  done = output is None and status is None
  body = {"id": f"resp_{turn.request_id}", "object": "response", "created_at": created,
          "status": _status(turn) if done else status, "error": error,
          "incomplete_details": incomplete_details(turn) if done else None,
          **settings, "output": output_items(turn, logprobs) if done else output}
  if done:
    body["usage"] = usage(turn)
    body["jaxagent"] = {"request_id": turn.request_id, "prompt_ids": turn.prompt_ids,
                        "output_ids": turn.output_ids, "output_logprobs": turn.output_logprobs,
                        "versions": turn.versions}
  return body


class _Events:
  """Server-sent events numbered in order (`sequence_number`)."""

  def __init__(self):
    self.n = 0

  def __call__(self, kind: str, **body) -> str:
    data = {"type": kind, "sequence_number": self.n, **body}
    self.n += 1
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


def failure(message: str, status: int) -> dict:
  """A stream's failure: OpenAI's `response.failed` shape, with the top-level `error` that
  makes OpenAI's clients raise it (an infrastructure failure is no answer to score)."""
  return {"message": message, "type": "server_error" if status >= 500 else
          "invalid_request_error", "code": status}


async def stream_events(turn: ChatTurn, settings: dict, created: int, logprobs: bool = False,
                        on_done: Optional[Callable[[], None]] = None) -> AsyncIterator[str]:
  """The answer as the Responses API's events: the message's text deltas as tokens
  arrive, each function call (whole, one arguments delta) once the turn ends, then
  `response.completed` (or `response.incomplete`) with the whole response. `on_done` is
  called once the turn has ended whole (to keep the response)."""
  event = _Events()
  item_id = f"msg_{turn.request_id}"
  sent: Optional[str] = None  # the message's text so far; None while it is not open

  def opened() -> list[str]:
    return [event("response.output_item.added", output_index=0, item={
                "id": item_id, "type": "message", "status": "in_progress",
                "role": "assistant", "content": []}),
            event("response.content_part.added", item_id=item_id, output_index=0,
                  content_index=0, part={"type": "output_text", "text": "",
                                         "annotations": [], "logprobs": []})]

  try:
    start = response_body(turn, settings, created, output=[], status="in_progress")
    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    try:
      async for delta in turn.text_deltas():
        if sent is None:
          for e in opened():
            yield e
          sent = ""
        yield event("response.output_text.delta", item_id=item_id, output_index=0,
                    content_index=0, delta=delta, logprobs=[])
        sent += delta
      items = output_items(turn, logprobs)
      if on_done is not None:
        on_done()
    except TurnCut as e:  # the status is sent: a failed response (the client raises it)
      error = failure(str(e), e.status)
      yield event("response.failed", error=error, response=response_body(
          turn, settings, created, output=[], status="failed",
          error={"code": "server_error", "message": str(e)}))
      return
    index = 0
    if items[0]["type"] == "message":
      part = items[0]["content"][0]
      if sent is None:
        for e in opened():
          yield e
        sent = ""
      if len(part["text"]) > len(sent) and part["text"].startswith(sent):
        yield event("response.output_text.delta", item_id=item_id, output_index=0,
                    content_index=0, delta=part["text"][len(sent):], logprobs=[])
      yield event("response.output_text.done", item_id=item_id, output_index=0,
                  content_index=0, text=part["text"], logprobs=part["logprobs"])
      yield event("response.content_part.done", item_id=item_id, output_index=0,
                  content_index=0, part=part)
      yield event("response.output_item.done", output_index=0, item=items[0])
      index = 1
    for i, item in enumerate(items[index:], index):
      yield event("response.output_item.added", output_index=i,
                  item=dict(item, arguments="", status="in_progress"))
      yield event("response.function_call_arguments.delta", item_id=item["id"],
                  output_index=i, delta=item["arguments"])
      yield event("response.function_call_arguments.done", item_id=item["id"],
                  output_index=i, name=item["name"], arguments=item["arguments"])
      yield event("response.output_item.done", output_index=i, item=item)
    final = response_body(turn, settings, created, logprobs=logprobs)
    yield event("response.incomplete" if final["status"] == "incomplete"
                else "response.completed", response=final)
  finally:
    turn.abort_unfinished()
