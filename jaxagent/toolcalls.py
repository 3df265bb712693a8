"""Tool calls in model text: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

The format the chat templates of `jaxagent.tokenizer` render, parsed back into
OpenAI-shaped tool calls. Standard library only (the environment tier and the
server both use it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Optional

from envs.values import json_depth  # (standard library only, as this module)


def parameters_problem(params: Any) -> Optional[str]:
  """What is wrong with a tool's `parameters` that is not a valid JSON Schema (by its
  `$schema`'s draft, 2020-12 where it names none), or None: its message, and where."""
  import jsonschema  # (only here: the rest of this module is the standard library's)

  said = "its parameters are not a JSON Schema: "
  if not isinstance(params, (dict, bool)):  # (a 500 from the draft's lookup: a reviewer)
    return said + f"{type(params).__name__}, not an object"
  if isinstance(params, dict) and not isinstance(params.get("$schema", ""), str):
    return said + (f"$schema is {type(params['$schema']).__name__}, not a string (the URI "
                   "of a draft)")
  try:
    jsonschema.validators.validator_for(
        params, default=jsonschema.Draft202012Validator).check_schema(params)
  except jsonschema.SchemaError as e:
    where = "".join(f"[{p!r}]" for p in e.absolute_path) or " itself"
    return said + f"{e.message[:300]} (at parameters{where})"
  return None

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# The deepest lists and dicts a tool call may nest (its name/arguments object included).
MAX_NESTING = 64
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
  name: str
  arguments: dict
  id: str = ""
  # The arguments' JSON text as the model wrote it (None when it wrote them as a string):
  # handed out as the call's `arguments`, so an agent that sends the call back sends the
  # text sampled, which the template writes again as it was (json.dumps wrote "café" as
  # "caf\u00e9" and 1e5 as 100000.0: the reply's tokens after it went untrained).
  raw_arguments: Optional[str] = None

  def openai(self) -> dict:
    arguments = self.raw_arguments if self.raw_arguments is not None else json.dumps(
        self.arguments, ensure_ascii=False)
    return {"id": self.id, "type": "function",
            "function": {"name": self.name, "arguments": arguments}}


@dataclasses.dataclass(frozen=True)
class ParsedOutput:
  content: str  # text outside tool-call blocks
  calls: list[ToolCall]
  errors: list[str]  # one message per malformed block
  # The text with only the well-formed blocks taken out (white space as written: a
  # stream has sent what came before the first block): what a gateway's client is
  # given as the reply's content when a block is malformed, so the call reaches the
  # environment as the policy wrote it (dropped, it was never seen, nor counted).
  kept: str = ""
  # Blocks past `parse_tool_calls`' limit: counted, neither parsed nor taken out of the text.
  unread: int = 0
  # The blocks read, in the text's order: ("call", index in `calls`) or ("error", index in
  # `errors`) (an environment answers them in that order).
  order: tuple = ()


def call_text(name: str, arguments: str) -> str:
  """A tool call in the chat template's format (what the environment parses), from its
  name and its arguments' JSON. A "</" can only sit inside a JSON string, where "<\\/"
  reads the same: escaped, an argument holding "</tool_call>" cannot close the call."""
  body = f'{{"name": {json.dumps(name)}, "arguments": {arguments}}}'.replace("</", "<\\/")
  return f"{OPEN}{body}{CLOSE}"


def with_calls(content: str, calls: list[tuple[str, str]]) -> str:
  """A reply's text from what a gateway hands out apart: its content (the text with its
  well-formed calls taken out) and its calls (name, arguments' JSON), written back in
  the template's format, where they were as far as a parse can tell: after the content,
  but before a block left open at its end (one cut by the token budget), which runs to
  the end of the text. Appended after it, the calls were read as inside it: the
  environment ran none of them, while the gateway and the record said they were made
  (a reviewer)."""
  written = "".join(call_text(name, arguments) for name, arguments in calls)
  open_at = [m.start() for m in _BLOCK.finditer(content) if not m.group(0).endswith(CLOSE)]
  at = open_at[-1] if open_at else len(content)
  return content[:at] + written + content[at:]


def _no_constant(name: str):
  raise ValueError(f"{name} is not plain JSON (finite numbers only)")


def _finite(literal: str) -> float:
  value = float(literal)
  if not math.isfinite(value):
    raise ValueError(f"{literal[:20]}... overflows a float (not JSON that can be sent back)")
  return value


# `json.loads` keywords that refuse what Python's json takes beyond plain JSON: NaN,
# Infinity, and numbers that overflow a float (`1e999` reads as infinity).
FINITE_JSON = {"parse_constant": _no_constant, "parse_float": _finite}


def _loads(text: str) -> Any:
  """Strict JSON: NaN and Infinity, which Python's json accepts, are malformed (they
  cannot be sent back out as JSON), and so are numbers that overflow a float (`1e999`
  reads as infinity), lone surrogates (`"\\udcff"`, which no file name, tokenizer or
  HTTP body can carry) and nesting deeper than MAX_NESTING (an agent's own client, a
  harness's SDK, may fail to serialise it back: pydantic stops at a few hundred)."""
  try:
    obj = json.loads(text, **FINITE_JSON)
    json.dumps(obj, ensure_ascii=False, allow_nan=False).encode("utf-8")
  except RecursionError:
    raise ValueError(f"nested deeper than {MAX_NESTING} levels") from None
  except UnicodeEncodeError:
    raise ValueError("a string holds a lone surrogate (not Unicode text)") from None
  if json_depth(obj) > MAX_NESTING:
    raise ValueError(f"nested deeper than {MAX_NESTING} levels")
  return obj


def _member_texts(text: str) -> dict[str, str]:
  """The JSON text of each member of the object `text` (valid JSON, as `_loads` read it),
  by key; the last of a repeated key, as `json.loads` keeps."""
  decoder, ws = json.JSONDecoder(**FINITE_JSON), re.compile(r"[ \t\n\r]*")
  out, i = {}, ws.match(text, 1).end()  # (after the "{")
  while text[i] != "}":
    key, i = decoder.raw_decode(text, i)
    i = ws.match(text, ws.match(text, i).end() + 1).end()  # (past the ":")
    _, end = decoder.raw_decode(text, i)
    out[key], i = text[i:end], ws.match(text, end).end()
    if text[i] == ",":
      i = ws.match(text, i + 1).end()
  return out


def _parse_block(body: str) -> tuple[str, dict, Optional[str]]:
  """A call's name, arguments, and the arguments' text as written (None for a string)."""
  obj = _loads(body.strip())
  if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
    raise ValueError('a tool call must be a JSON object with a string "name"')
  other = sorted(k for k in obj if k not in ("name", "arguments"))
  if other:  # ("argumesss" read as no arguments: a call the model did not write, red team 41)
    raise ValueError('a tool call has only "name" and "arguments" (it has '
                     f"{', '.join(map(json.dumps, other))[:100]})")
  args = obj.get("arguments", {})
  raw = _member_texts(body.strip()).get("arguments") if isinstance(args, dict) else None
  if isinstance(args, str):  # some models write the arguments as a JSON string
    args = _loads(args) if args.strip() else {}
    if json_depth(args) + 1 > MAX_NESTING:  # as deep as the same call written as an object
      raise ValueError(f"nested deeper than {MAX_NESTING} levels")
  if not isinstance(args, dict):
    raise ValueError('"arguments" must be a JSON object')
  return obj["name"], args, raw


def parse_tool_calls(text: str, id_prefix: str = "call",
                     limit: Optional[int] = None) -> ParsedOutput:
  """Splits model text into content and tool calls; malformed blocks become errors. Only
  the first `limit` blocks (all when None) are parsed; the rest are counted (`unread`)."""
  calls, errors, content, kept, order = [], [], [], [], []
  pos, unread = 0, 0
  for i, m in enumerate(_BLOCK.finditer(text)):
    if limit is not None and i >= limit:
      unread = sum(1 for _ in _BLOCK.finditer(text, m.start()))
      break
    content.append(text[pos:m.start()])
    kept.append(text[pos:m.start()])
    pos = m.end()
    body = m.group(1)
    if not m.group(0).endswith(CLOSE):
      order.append(("error", len(errors)))
      errors.append(f"tool call {i}: missing {CLOSE}")
      kept.append(m.group(0))
      continue
    try:
      name, args, raw = _parse_block(body)
      order.append(("call", len(calls)))
      calls.append(ToolCall(name, args, f"{id_prefix}_{i}", raw))
    except (ValueError, json.JSONDecodeError) as e:
      order.append(("error", len(errors)))
      errors.append(f"tool call {i}: {e}: {body.strip()[:200]!r}")
      kept.append(m.group(0))
  content.append(text[pos:])
  kept.append(text[pos:])
  return ParsedOutput("".join(content).strip(), calls, errors, "".join(kept), unread,
                      tuple(order))


def hands_out_whole(parsed: ParsedOutput, content: str) -> bool:
  """Whether a reply handed out as `content` and `parsed.calls` apart (a gateway's) reads
  back, written together again (`with_calls`, as the agents do), as the same calls and
  malformed blocks. Taking a call out joins the text either side of it: `<tool_` + a
  call + `call>` opened a block the policy never wrote, which the environment ran first
  while the gateway's record said no such call was made (a red team)."""
  again = parse_tool_calls(with_calls(content, [
      (c.name, c.openai()["function"]["arguments"]) for c in parsed.calls]))
  return (len(again.errors) == len(parsed.errors)
          and [(c.name, c.arguments) for c in again.calls]
          == [(c.name, c.arguments) for c in parsed.calls])
