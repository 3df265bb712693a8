"""Anthropic's Messages API on the rollout server (`POST /v1/messages`).

The request body; its conversion to the internal chat form (OpenAI-shaped message dicts:
`tool_use` blocks become an assistant message's `tool_calls`, `tool_result` blocks become
`tool` messages, tools become function schemas), so that the same chat renders to the same
tokens through either gateway; the answer as Anthropic's content blocks; its server-sent
events; and errors as Anthropic's `{"type": "error", "error": {"type", "message"}}`. The
route is in `server.py`, beside the OpenAI one, and shares its rendering, sampling and
session record (`rollout_server.chat`).

Refused, naming the field: `stop_sequences` (a turn ends at the chat template's stop
token; cutting at text would cut sampled tokens), a `tool_choice` other than `auto` (the
engine samples freely: it can neither force nor forbid a tool call), a last message of the
assistant's (Anthropic continues it; the chat template closes it), content blocks other
than `text`, `tool_use` and `tool_result` (images, documents, thinking), and fields that
would change what is sampled (`chat.UNSERVED`: extended `thinking`, ...). `temperature`,
`top_p`, `top_k` and `seed` are read from the body (recent `anthropic` clients send the
first three through `extra_body`).
"""

from __future__ import annotations

import json
from typing import Annotated, AsyncIterator, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from rollout_server.chat import (SEED, TEMPERATURE, TOP_K, TOP_P, ChatTurn, Name,
                                 ShapedErrorsRoute, TurnCut, unserved)

# -- request bodies -----------------------------------------------------------------------


class _Block(BaseModel):
  # Fields that change nothing here (cache_control, citations, ...) are dropped.
  model_config = ConfigDict(extra="ignore")


class TextBlock(_Block):
  type: Literal["text"]
  text: str


class ToolUseBlock(_Block):
  type: Literal["tool_use"]
  id: str
  name: str
  input: dict


class ToolResultBlock(_Block):
  type: Literal["tool_result"]
  tool_use_id: str
  content: Union[str, list[TextBlock]] = ""
  is_error: bool = False


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock],
                         Field(discriminator="type")]


class MessageParam(BaseModel):
  model_config = ConfigDict(extra="forbid")
  role: Literal["user", "assistant"]
  content: Union[str, list[ContentBlock]]


class ToolParam(_Block):
  type: Optional[Literal["custom"]] = None  # Anthropic's server tools are not served here
  name: str = Field(min_length=1)
  description: Optional[str] = None
  input_schema: dict


class ToolChoice(BaseModel):
  model_config = ConfigDict(extra="forbid")
  type: Literal["auto", "any", "tool", "none"]
  name: Optional[str] = None
  disable_parallel_tool_use: Optional[bool] = None


class Metadata(BaseModel):
  model_config = ConfigDict(extra="forbid")
  user_id: Optional[str] = None


class MessagesBody(BaseModel):
  # Unknown fields are accepted and ignored, as on the OpenAI route.
  model_config = ConfigDict(extra="allow", strict=True)
  model: Name
  max_tokens: int = Field(ge=1)
  messages: list[MessageParam] = Field(min_length=1)
  system: Optional[Union[str, list[TextBlock]]] = None
  tools: Optional[list[ToolParam]] = None
  tool_choice: Optional[ToolChoice] = None
  temperature: float = TEMPERATURE
  top_p: float = TOP_P
  top_k: int = TOP_K
  stop_sequences: Optional[list[str]] = None
  stream: bool = False
  metadata: Optional[Metadata] = None
  seed: Optional[int] = SEED  # not Anthropic's: the sampling seed, as on the OpenAI route


# -- to the internal chat form --------------------------------------------------------------


def _text(content: Union[str, list[TextBlock]]) -> str:
  return content if isinstance(content, str) else "".join(b.text for b in content)


def _user_messages(content: Union[str, list], where: str, called: set) -> list[dict]:
  """A user message: its tool results as `tool` messages, its text as user messages, in
  their order. `called`: the ids of the tool uses of the assistant message before (a
  result answers one of them, as Anthropic's API requires)."""
  if isinstance(content, str):
    return [{"role": "user", "content": content}]
  out: list[dict] = []
  for j, b in enumerate(content):
    if isinstance(b, ToolUseBlock):
      raise ValueError(f"{where}.content.{j}: a tool_use block belongs in an assistant message")
    if isinstance(b, ToolResultBlock) and b.tool_use_id not in called:
      raise ValueError(f"{where}.content.{j}: tool_result for tool_use_id {b.tool_use_id!r}, "
                       "which the assistant message before did not call ("
                       + (f"it called {', '.join(sorted(map(repr, called)))}" if called
                          else "it called no tool") + ")")
    if isinstance(b, ToolResultBlock):
      tool = {"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)}
      if b.is_error:  # kept in the session record; the template renders the text
        tool["is_error"] = True
      out.append(tool)
    elif out and out[-1]["role"] == "user":
      out[-1]["content"].append(b.text)
    else:
      out.append({"role": "user", "content": [b.text]})
  for m in out:  # (joined once: added to one by one, 200,000 blocks took 40 s; red team 116)
    if m["role"] == "user":
      m["content"] = "".join(m["content"])
  return out


def _assistant_message(content: Union[str, list], where: str) -> dict:
  """An assistant message: its text, and its tool uses as OpenAI-shaped tool calls."""
  if isinstance(content, str):
    return {"role": "assistant", "content": content}
  texts, calls = [], []
  for j, b in enumerate(content):
    if isinstance(b, ToolResultBlock):
      raise ValueError(f"{where}.content.{j}: a tool_result block belongs in a user message")
    if isinstance(b, TextBlock):
      texts.append(b.text)
    else:
      calls.append({"id": b.id, "type": "function",
                    "function": {"name": b.name,
                                 "arguments": json.dumps(b.input, ensure_ascii=False)}})
  message = {"role": "assistant", "content": "".join(texts)}
  if calls:
    message["tool_calls"] = calls
  return message


def _function_schema(tool: ToolParam) -> dict:
  function = {"name": tool.name}
  if tool.description is not None:
    function["description"] = tool.description
  function["parameters"] = tool.input_schema
  return {"type": "function", "function": function}


def chat_messages(body: MessagesBody) -> tuple[list[dict], Optional[list[dict]]]:
  """The request in the internal chat form: (messages, tool schemas), OpenAI's shapes.
  ValueError names what cannot be served."""
  if body.stop_sequences:
    raise ValueError("stop_sequences: not supported (a turn ends at the chat template's stop "
                     "token; stopping at text would cut sampled tokens)")
  why = unserved(body.model_extra)  # (extended thinking, ...)
  if why is not None:
    raise ValueError(why)
  if body.tool_choice is not None and body.tool_choice.type != "auto":
    raise ValueError(f"tool_choice: only auto is supported, got {body.tool_choice.type!r} (the "
                     "engine samples freely: it can neither force nor forbid a tool call)")
  if body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use:
    raise ValueError("tool_choice.disable_parallel_tool_use: not supported (sampling cannot "
                     "be held to one tool use; an answer may hold several)")
  if body.messages[-1].role == "assistant":
    raise ValueError(f"messages.{len(body.messages) - 1}: the last message must be the user's "
                     "(continuing an assistant's text is not supported)")
  messages = []
  system = _text(body.system) if body.system is not None else ""
  if system:
    messages.append({"role": "system", "content": system})
  # Consecutive messages of a role are one turn, as Anthropic's API takes them: their
  # text and tool uses one assistant message, their results answering its tool uses.
  called: set = set()  # the tool uses of the last assistant turn
  role = None
  merged: dict[int, list[str]] = {}  # (a message's text added to: joined once, at the end;
  # added to one by one, 4,000 messages of 8 KB took 24 s; red team 116)

  def add_text(text: str) -> None:
    merged.setdefault(len(messages) - 1, [messages[-1]["content"]]).append(text)

  for i, m in enumerate(body.messages):
    where = f"messages.{i}"
    if m.role == "user" and (m.content == "" or (isinstance(m.content, list) and all(
        isinstance(b, TextBlock) and not b.text for b in m.content))):
      # (an assistant's may be: a reply the policy left empty, sent back by its agent, is
      # the policy's move, refused it was counted as the server's failure: a reviewer)
      raise ValueError(f"{where}.content: empty (a user message needs content)")
    if m.role == "user":
      turn = _user_messages(m.content, where, called)
      if role == "user" and messages[-1]["role"] == turn[0]["role"] == "user":
        add_text(turn.pop(0)["content"])
      messages += turn
    else:
      message = _assistant_message(m.content, where)
      calls = message.get("tool_calls", [])
      if role == "assistant":
        add_text(message["content"])
        if calls:  # (the message and its list are this call's own)
          messages[-1].setdefault("tool_calls", []).extend(calls)
      else:
        messages.append(message)
        called = set()
      called |= {c["id"] for c in calls}
    role = m.role
  for at, texts in merged.items():
    messages[at]["content"] = "".join(texts)
  tools = [_function_schema(t) for t in body.tools] if body.tools else None
  return messages, tools


# -- answers --------------------------------------------------------------------------------


def content_blocks(message: dict) -> list[dict]:
  """An internal assistant message as Anthropic content blocks: its text (when there is
  any, or nothing else), then a `tool_use` block a call."""
  calls = message.get("tool_calls") or []
  blocks = []
  if message["content"] or not calls:
    blocks.append({"type": "text", "text": message["content"]})
  for c in calls:
    blocks.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                   "input": json.loads(c["function"]["arguments"])})
  return blocks


def stop_reason(turn: ChatTurn) -> str:
  """end_turn, tool_use (a stop after tool calls), max_tokens, or
  model_context_window_exceeded (a turn cut by the context's end before max_tokens: it
  said max_tokens, red team 24)."""
  finish = turn.finish_reason
  if finish == "stop" and turn.finish().get("tool_calls"):
    return "tool_use"
  if finish == "length" and len(turn.output_ids) < turn.max_new_tokens:
    return "model_context_window_exceeded"
  return {"stop": "end_turn", "length": "max_tokens"}.get(finish, finish)


def _usage(turn: ChatTurn) -> dict:
  return {"input_tokens": len(turn.prompt_ids), "output_tokens": len(turn.output_ids)}


def message_body(turn: ChatTurn, model: str) -> dict:
  """The answer of a finished turn. `jaxagent` (not Anthropic's) holds the token ids,
  log-probs and policy versions the engine sampled, as the session records them."""
  return {"id": f"msg_{turn.request_id}", "type": "message", "role": "assistant",
          "model": model, "content": content_blocks(turn.finish()),
          "stop_reason": stop_reason(turn), "stop_sequence": None, "usage": _usage(turn),
          "jaxagent": {"request_id": turn.request_id, "prompt_ids": turn.prompt_ids,
                       "output_ids": turn.output_ids, "output_logprobs": turn.output_logprobs,
                       "versions": turn.versions}}


def _event(kind: str, **body) -> str:
  return f"event: {kind}\ndata: {json.dumps({'type': kind, **body})}\n\n"


async def stream_events(turn: ChatTurn, model: str) -> AsyncIterator[str]:
  """The answer as Anthropic's server-sent events: text deltas as tokens arrive, tool uses
  (whole, one `input_json_delta` each) once the turn ends."""
  sent: Optional[str] = None  # the text block's text so far; None while it is not open
  try:
    yield _event("message_start", message={
        "id": f"msg_{turn.request_id}", "type": "message", "role": "assistant",
        "model": model, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": len(turn.prompt_ids), "output_tokens": 0}})
    try:
      async for delta in turn.text_deltas():
        if sent is None:
          yield _event("content_block_start", index=0,
                       content_block={"type": "text", "text": ""})
          sent = ""
        yield _event("content_block_delta", index=0,
                     delta={"type": "text_delta", "text": delta})
        sent += delta
      blocks = content_blocks(turn.finish())
    except TurnCut as e:  # the status is sent: an error event (the client raises it)
      yield _event("error", error={"type": _ERROR_TYPES.get(e.status, "api_error"),
                                   "message": str(e)})
      return
    index = 0
    if blocks[0]["type"] == "text":
      text = blocks[0]["text"]
      if sent is None:
        yield _event("content_block_start", index=0, content_block={"type": "text", "text": ""})
        sent = ""
      if len(text) > len(sent) and text.startswith(sent):
        yield _event("content_block_delta", index=0,
                     delta={"type": "text_delta", "text": text[len(sent):]})
      yield _event("content_block_stop", index=0)
      index = 1
    for block in blocks[index:]:
      yield _event("content_block_start", index=index, content_block=dict(block, input={}))
      yield _event("content_block_delta", index=index, delta={
          "type": "input_json_delta", "partial_json": json.dumps(block["input"])})
      yield _event("content_block_stop", index=index)
      index += 1
    yield _event("message_delta", delta={"stop_reason": stop_reason(turn), "stop_sequence": None},
                 usage={"output_tokens": len(turn.output_ids)})
    yield _event("message_stop")
  finally:
    turn.abort_unfinished()


# -- errors ---------------------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                422: "invalid_request_error", 429: "rate_limit_error", 502: "api_error",
                503: "overloaded_error", 529: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
  """Anthropic's error shape for an HTTP status."""
  return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"),
                                     "message": message}}


class AnthropicRoute(ShapedErrorsRoute):
  """Anthropic's error shape."""

  @staticmethod
  def error(status: int, message: str, field: Optional[str]) -> dict:
    return error_body(status, message)
