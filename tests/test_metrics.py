"""Per-step episode metrics, hand-computed."""

from jaxagent.agent import Episode
from jaxagent.metrics import cut_jsonl, episode_metrics
from jaxagent.scheduler import Group


def episode(reward, calls=0, invalid=0):
  return Episode("t", "s", "g", [], [reward], {"status": "pass" if reward else "fail",
                                               "reward": reward}, "completed",
                 tool_calls=calls, invalid_tool_calls=invalid)


def test_tool_call_rate_and_groups_with_signal():
  mixed = Group(0, None, [episode(1.0, calls=1), episode(0.0, calls=1, invalid=1)])
  flat = Group(1, None, [episode(0.0), episode(0.0, calls=2, invalid=1)])
  m = episode_metrics([mixed, flat], [mixed, flat], learner_version=0)
  # Valid calls in episodes 0 and 3 (2 calls, 1 invalid); episode 1's call was invalid.
  assert m["tool_call_rate"] == 0.5
  assert m["groups_with_signal"] == 1 and m["success_rate"] == 0.25


def test_what_the_judge_made_of_the_passes_is_counted():
  def judged(status, **details):
    ep = episode(1.0 if status == "pass" else 0.0)
    ep.verdict = {"status": status, "reward": ep.verdict["reward"],
                  "details": {"judge": "j", **details}}
    return ep

  g = Group(0, None, [judged("pass"), judged("fail", false_positive=True),
                      judged("fail", judge_unparsed=True), judged("fail", judge_too_long=True),
                      episode(0.0)])  # a fail of the tests: never shown to the judge
  m = episode_metrics([g], [g], learner_version=0)
  assert (m["judge_asked"], m["judge_false_positives"], m["judge_unparsed"],
          m["judge_too_long"]) == (4, 1, 1, 1)
  assert "judge_asked" not in episode_metrics([Group(1, None, [episode(1.0)])], [], 0)


def test_cut_jsonl_keeps_rows_up_to_the_step(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1}\n{"note": "no step"}\n{"step": 2}\n{"step": 3}\n'
                  '{"step": 2, "again": true}\n{"step": 4, "los')  # the last cut by a kill
  assert cut_jsonl(str(path), 2) == 4
  assert path.read_text() == ('{"step": 1}\n{"note": "no step"}\n{"step": 2}\n'
                              '{"step": 2, "again": true}\n')
  assert cut_jsonl(str(tmp_path / "absent.jsonl"), 2) == 0
