import json

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, trainers

from jaxagent.tokenizer import CHATML_TOOLS_TEMPLATE, Tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "calculate", "description": "Evaluate arithmetic",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]


def test_byte_level_round_trip_and_ids():
  tok = Tokenizer.byte_level()
  text = "héllo wörld <tool_call> ✓\n\t"
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert tok.encode("A") == [65]  # byte value is the id
  assert tok.vocab_size <= 384  # fits the tiny preset
  assert tok.encode("1 to 16") == [49, 32, 116, 111, 32, 256 + 16]  # digit pairs are one token
  assert len(tok.encode("<|im_start|>")) == 1 and len(tok.encode("<tool_call>")) == 1
  assert tok.stop_ids == (tok.encode("<|im_end|>")[0], tok.eos_id)


def test_chat_template_renders_tools_calls_and_results():
  tok = Tokenizer.byte_level()
  messages = [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": "What is 2+3?"},
      {"role": "assistant", "content": "",
       "tool_calls": [{"id": "c1", "type": "function",
                       "function": {"name": "calculate",
                                    "arguments": json.dumps({"expression": "2+3"})}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "5"},
      {"role": "assistant", "content": "5"},
  ]
  text = tok.render(messages, tools=TOOLS, add_generation_prompt=False)
  assert text.startswith("<|im_start|>system\nBe brief.\n\nYou may call tools.")
  assert json.dumps(TOOLS[0]) in text  # schema as plain JSON, not HTML-escaped
  assert ('<|im_start|>assistant\n<tool_call>{"name": "calculate", "arguments": '
          '{"expression": "2+3"}}</tool_call><|im_end|>\n') in text
  assert "<|im_start|>tool\n5<|im_end|>\n" in text
  assert text.endswith("<|im_start|>assistant\n5<|im_end|>\n")
  ids = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)
  assert tok.decode(ids) == text + "<|im_start|>assistant\n"
  # Arguments given as a dict render the same as the JSON string.
  messages[2]["tool_calls"][0]["function"]["arguments"] = {"expression": "2+3"}
  assert tok.render(messages, tools=TOOLS, add_generation_prompt=False) == text


def test_history_is_a_prefix_of_the_next_turn():
  tok = Tokenizer.byte_level()
  history = [{"role": "user", "content": "guess"}]
  first = tok.apply_chat_template(history)
  history += [{"role": "assistant", "content": "8"}, {"role": "user", "content": "higher"}]
  second = tok.apply_chat_template(history)
  assert second[:len(first)] == first


def test_trained_bpe_tokenizer_through_the_same_interface(tmp_path):
  bpe = tokenizers.Tokenizer(models.BPE(unk_token=None))
  bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = tokenizers.decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                 "<|im_end|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  bpe.train_from_iterator(["the quick brown fox guesses the number"] * 50, trainer)
  path = tmp_path / "tokenizer.json"
  bpe.save(str(path))
  tok = Tokenizer.from_file(str(path), CHATML_TOOLS_TEMPLATE, eos_token="<|endoftext|>",
                            pad_token="<|endoftext|>", stop_tokens=["<|im_end|>"])
  ids = tok.apply_chat_template([{"role": "user", "content": "the quick fox"}])
  assert tok.decode(ids).endswith("<|im_start|>assistant\n")
  assert len(ids) < len(tok.render([{"role": "user", "content": "the quick fox"}]))
  assert tok.identity()["vocab_sha256"] != Tokenizer.byte_level().identity()["vocab_sha256"]


def test_bad_messages_are_named():
  tok = Tokenizer.byte_level()
  with pytest.raises(ValueError, match="message 1"):
    tok.render([{"role": "user", "content": "x"}, {"content": "no role"}])
  with pytest.raises(ValueError, match="not in the vocabulary"):
    Tokenizer(tok.tok, CHATML_TOOLS_TEMPLATE, eos_token="<nope>", pad_token="<nope>")
