"""Token write-ahead log: commits before side effects, and token-exact replay of an
episode a dead trainer left in flight."""

import asyncio
import json
import os

import numpy as np
import pytest

from envs.base import TaskSpec, make
from jaxagent.agent import run_whitebox
from jaxagent.config import AgentConfig
from jaxagent.errors import RunWriteFailed
from jaxagent.wal import Replay, TokenWAL, read_log, take_replay
from tests.test_agent import TOK, ScriptedEngine

TASK = TaskSpec("t", "guess_number", {"secret": 11, "process_reward": 0.1})
CFG = AgentConfig(max_turns=6, max_new_tokens=4)


class WatchedEnv:
  """guess_number that checks, at each step, that the action is already in the log."""

  def __init__(self, path):
    self.inner, self.path, self.seen = make("guess_number"), path, []

  def __getattr__(self, name):
    return getattr(self.inner, name)

  async def step(self, action):
    turns = [r for r in read_log(self.path) if r["kind"] == "turn"]
    self.seen.append(TOK.decode(turns[-1]["output_ids"][:-1]) if turns else None)
    return await self.inner.step(action)


def play(engine, env=None, **kw):
  return asyncio.run(run_whitebox(env or make("guess_number"), TASK, engine, TOK, CFG,
                                  session_id="s1", group_id="g", **kw))


def test_every_turn_is_logged_before_the_environment_sees_it(tmp_path):
  wal = TokenWAL(str(tmp_path))
  log = wal.open("s1", group_id="g", task=TASK.to_dict(), episode=0)
  env = WatchedEnv(log.path)
  ep = play(ScriptedEngine(["8", "12", "11"]), env, log=log)
  assert ep.success and env.seen == ["8", "12", "11"]  # each action durable before its step
  kinds = [r["kind"] for r in read_log(log.path)]
  assert kinds == ["start", "turn", "obs", "turn", "obs", "turn", "obs", "end"]
  (replay,) = wal.pending()
  assert replay.start["task"]["id"] == "t" and len(replay) == 3
  wal.discard_group("g")
  assert wal.pending() == []


def test_a_dead_trainers_episode_is_replayed_token_exactly(tmp_path):
  wal = TokenWAL(str(tmp_path))
  log = wal.open("s1", group_id="g", task=TASK.to_dict(), episode=2)
  whole = play(ScriptedEngine(["8", "12", "10", "11"]), log=log)
  # The trainer died during turn 3's step: the log has turns 0-2 (the last without its
  # observation) and half a line.
  lines = open(log.path).read().splitlines(keepends=True)
  cut = [i for i, line in enumerate(lines) if json.loads(line)["kind"] == "turn"][2]
  with open(log.path, "w") as f:
    f.writelines(lines[:cut + 1])
    f.write(lines[cut + 1][:20])
  (replay,) = wal.pending()
  assert take_replay([replay], "t", 1) is None and take_replay([replay], "t", 2) is replay
  assert len(replay) == 3
  engine = ScriptedEngine(["11"])  # only the turn that was never committed is sampled
  resumed = play(engine, replay=replay)
  assert len(engine.prompts) == 1 and resumed.success
  assert resumed.turn_rewards == whole.turn_rewards
  (a,), (b,) = whole.segments, resumed.segments
  for field in ("tokens", "loss_mask", "rollout_logp", "versions", "turn_ids"):
    np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


def test_a_compacted_episode_replays_with_its_logged_summary(tmp_path):
  """The summary compaction wrote is logged and taken back on replay (not asked again:
  a summariser whose weights moved would write another, and the logged prompts after
  it would not rebuild)."""
  from tests.test_agent import LONG

  task = TaskSpec("t", "guess_number", {"secret": 11, "max_turns": 6, "prompt": LONG})
  cfg = AgentConfig(max_turns=6, max_new_tokens=4, max_context_tokens=300,
                    compaction="summary", keep_last_messages=2, summary_max_tokens=16)

  def run(engine, **kw):
    return asyncio.run(run_whitebox(make("guess_number"), task, engine, TOK, cfg,
                                    session_id="s1", group_id="g", **kw))

  wal = TokenWAL(str(tmp_path))
  log = wal.open("s1", group_id="g", task=task.to_dict(), episode=0)
  whole = run(ScriptedEngine(["1", "2", "3", "Tried 1 to 3: higher.", "4", "11"]), log=log)
  assert whole.success and whole.compactions == 1
  records = read_log(log.path)
  assert [r["text"] for r in records if r["kind"] == "summary"] == ["Tried 1 to 3: higher."]
  # Died after turn 3 (the first after the summary) was committed.
  last = [i for i, r in enumerate(records) if r["kind"] == "turn"][3]
  engine = ScriptedEngine(["11"])  # no summary to write: only the last turn is sampled
  resumed = run(engine, replay=Replay(records[:last + 1]))
  assert resumed.success and len(engine.prompts) == 1 and resumed.replayed_turns == 4
  for a, b in zip(whole.segments, resumed.segments, strict=True):
    for field in ("tokens", "loss_mask", "rollout_logp", "versions"):
      np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


def test_a_summary_logged_after_a_replays_cut_is_not_the_resumed_episodes(tmp_path):
  """A replay cut at the first turn of weights the resumed run gave up kept the summaries
  logged after it: a later compaction of the new turns put the stopped run's summary of
  another conversation in their context, and logged it again (a reviewer)."""
  from tests.test_agent import LONG

  task = TaskSpec("t", "guess_number", {"secret": 11, "max_turns": 6, "prompt": LONG})
  cfg = AgentConfig(max_turns=6, max_new_tokens=4, max_context_tokens=300,
                    compaction="summary", keep_last_messages=2, summary_max_tokens=16)

  def run(engine, path, **kw):
    log = TokenWAL(str(tmp_path / path)).open("s1", group_id="g", task=task.to_dict(),
                                              episode=0)
    ep = asyncio.run(run_whitebox(make("guess_number"), task, engine, TOK, cfg,
                                  session_id="s1", group_id="g", log=log, **kw))
    return ep, read_log(log.path)

  _, records = run(ScriptedEngine(["1", "2", "3", "Tried 1 to 3: higher.", "4", "11"]), "a")
  for r in records:  # (the stopped run's weights moved after turn 0)
    if r["kind"] == "turn" and r["turn"] >= 1:
      r["versions"] = [6] * len(r["versions"])
  replay = Replay(records).up_to_version(5)
  assert len(replay) == 1 and replay.summaries == {}
  engine = ScriptedEngine(["9", "10", "New summary.", "12", "11"])
  ep, again = run(engine, "b", replay=replay)
  assert ep.success and ep.compactions == 1 and engine.replies == []
  assert [r["text"] for r in again if r["kind"] == "summary"] == ["New summary."]
  # Cut later, the summary the kept turns were built on stays.
  kept = Replay(records[:]).up_to_version(6)
  assert kept.summaries == {3: "Tried 1 to 3: higher."}


def test_a_compaction_the_engines_refusal_made_is_made_again_on_replay(tmp_path):
  """An engine that takes shorter prompts than agent.max_context_tokens lowered the
  episode's limit and compacted; the limit was not logged, so a replay (the config's
  limit) did not compact there, its prompts no longer rebuilt, and the finished episode
  was played again as an infrastructure error (a reviewer)."""
  from tests.test_agent import PromptLimited

  task = TaskSpec("t", "guess_number", {"secret": 11, "max_turns": 6,
                                        "prompt": "Guess my number, {low} to {high}."})
  cfg = AgentConfig(max_turns=6, max_new_tokens=4, max_context_tokens=1000,
                    compaction="fork", keep_last_messages=2)

  def run(engine, **kw):
    return asyncio.run(run_whitebox(make("guess_number"), task, engine, TOK, cfg,
                                    session_id="s1", group_id="g", **kw))

  log = TokenWAL(str(tmp_path)).open("s1", group_id="g", task=task.to_dict(), episode=0)
  whole = run(PromptLimited(["1", "2", "3", "4", "11"], 70), log=log)
  assert whole.success and whole.compactions == 1
  records = read_log(log.path)
  assert [r["kind"] for r in records].count("limit") == 1
  # Killed before the end record (every turn committed), twice: the replay logs the limit
  # again, as a summary, for a replay of its own log (a reviewer).
  for i in range(2):
    engine = ScriptedEngine([])
    log = TokenWAL(str(tmp_path / f"again{i}")).open("s1", group_id="g",
                                                     task=task.to_dict(), episode=0)
    again = run(engine, replay=Replay([r for r in records if r["kind"] != "end"]), log=log)
    assert not again.infra_error, again.reason
    assert again.success and again.replayed_turns == whole.turns and engine.prompts == []
    for a, b in zip(whole.segments, again.segments, strict=True):
      for field in ("tokens", "loss_mask", "rollout_logp", "versions"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    records = read_log(log.path)


def test_a_replay_the_environment_answers_differently_is_dropped_not_scored(tmp_path):
  wal = TokenWAL(str(tmp_path))
  log = wal.open("s1", group_id="g", task=TASK.to_dict(), episode=0)
  play(ScriptedEngine(["8", "11"]), log=log)
  records = read_log(log.path)
  records[2]["hash"] = "0" * 16  # the logged observation of turn 0 no longer matches
  ep = play(ScriptedEngine([]), replay=Replay(records))
  assert ep.infra_error and ep.infra_kind == "wal_replay" and "turn 0" in ep.reason


def test_the_environments_state_hash_is_logged_and_checked(tmp_path):
  wal = TokenWAL(str(tmp_path))
  log = wal.open("s1", group_id="g", task=TASK.to_dict(), episode=0)
  play(ScriptedEngine(["8", "11"]), log=log)
  obs = [r for r in read_log(log.path) if r["kind"] == "obs"]
  assert all(len(r["state"]) == 16 for r in obs) and obs[0]["state"] != obs[1]["state"]
  # The same actions against another secret: the first answer reads the same ("Higher."),
  # the environment's state does not.
  other = TaskSpec("t", "guess_number", {"secret": 12, "process_reward": 0.1})
  ep = asyncio.run(run_whitebox(make("guess_number"), other, ScriptedEngine([]), TOK, CFG,
                                session_id="s2", replay=Replay(read_log(log.path))))
  assert ep.infra_error and ep.infra_kind == "wal_replay"


def test_a_replay_stops_at_the_first_turn_of_weights_the_resumed_run_gave_up():
  from jaxagent.wal import Replay

  turns = [{"kind": "turn", "turn": t, "versions": v} for t, v in
           enumerate([[2, 2], [2, 3], [4, 4]])]
  r = Replay([{"kind": "start", "task": {"id": "t"}, "episode": 0}, *turns])
  assert len(r.up_to_version(3)) == 2  # (with versions 2 and 3)
  assert len(Replay([{"kind": "start"}, *turns]).up_to_version(2)) == 1


def test_a_resume_sets_the_logs_aside_until_its_first_checkpoint(tmp_path):
  """A resumed run logs afresh but keeps the stopped run's logs aside: a crash in its own
  start-up (before a checkpoint of it is whole) still replays them (a chaos helper's
  finding: they were deleted at once); a re-logged episode supersedes its old log."""
  wal = TokenWAL(str(tmp_path))
  for group, episode, turns in (("g0", 0, ["8", "12"]), ("g1", 1, ["8"])):
    log = wal.open(f"{group}-{episode}-r0", group_id=group, task=TASK.to_dict(),
                   episode=episode)
    play(ScriptedEngine(turns + ["11"]), log=log)
  assert sorted(len(r) for r in wal.pending()) == [2, 3]
  wal = TokenWAL(str(tmp_path))  # the resumed run
  wal.set_aside()
  assert not [n for n in os.listdir(tmp_path) if n.endswith(".jsonl")]
  assert sorted(len(r) for r in wal.pending()) == [2, 3]  # a crash now: still replayed
  # The resumed run re-logs episode 1 of task t (and goes on from it).
  log = wal.open("g5-1-r0", group_id="g5", task=TASK.to_dict(), episode=1)
  play(ScriptedEngine(["8", "9", "11"]), log=log)
  assert sorted(len(r) for r in wal.pending()) == [3, 3]  # the old log of episode 1 gone
  wal.set_aside()  # a second resume: names do not collide
  assert sorted(len(r) for r in wal.pending()) == [3, 3]
  wal.drop_aside()  # a checkpoint of the resumed run is whole
  assert wal.pending() == []


def test_a_second_resume_never_replays_turns_of_weights_the_first_gave_up(tmp_path):
  """Red team 21: a resume from version 2 cut the stopped run's later turns in memory
  only; the logs it set aside kept them, and a second resume, from the first one's own
  checkpoint at version 3, replayed the stopped run's version-3 turns (other weights,
  other log-probs) as its own. Setting aside cuts the logs on disk."""
  def write(name, session, task_id, versions):
    with open(tmp_path / name, "a") as f:
      f.write(json.dumps({"session": session, "kind": "start", "group_id": name[:-6],
                          "task": {"id": task_id}, "episode": 0, "run": "r1"}) + "\n")
      for t, v in enumerate(versions):
        f.write(json.dumps({"session": session, "kind": "turn", "turn": t,
                            "versions": [v]}) + "\n")
        f.write(json.dumps({"session": session, "kind": "obs", "turn": t,
                            "hash": "h"}) + "\n")

  write("g6.jsonl", "g6-0-r0", "a", [2, 3, 3])
  write("g6.jsonl", "g6-1-r0", "b", [1, 2])
  TokenWAL(str(tmp_path)).set_aside(2)  # the first resume, from version 2
  again = TokenWAL(str(tmp_path))  # the second, from the first's checkpoint at version 3
  lengths = {r.start["task"]["id"]: len(r.up_to_version(3)) for r in again.pending()}
  assert lengths == {"a": 1, "b": 2}
  records = read_log(str(tmp_path / "replaying" / "g6.jsonl"))
  assert [r["kind"] for r in records if r["session"] == "g6-0-r0"] == ["start", "turn", "obs"]
  assert not [n for n in os.listdir(tmp_path / "replaying") if not n.endswith(".jsonl")]
  # Logs already set aside are cut too: a resume whose latest checkpoint was unreadable
  # restores an older one, below the versions an earlier resume's cut kept. (Tests by
  # mutation: a cut of the live logs alone passed.)
  write("g7.jsonl", "g7-0-r0", "c", [1, 2, 3])
  TokenWAL(str(tmp_path)).set_aside(3)  # (nothing of g7 cut: all at or below 3)
  TokenWAL(str(tmp_path)).set_aside(1)  # (fallen back to version 1)
  aside = [r for name in os.listdir(tmp_path / "replaying") if name.endswith(".jsonl")
           for r in read_log(str(tmp_path / "replaying" / name))]
  assert [r["versions"] for r in aside if r["kind"] == "turn"] == [[1], [1]]


def test_the_logs_of_groups_a_checkpoint_trained_on_are_forgotten_by_their_keys(tmp_path):
  """A group trained on before a checkpoint keeps its log until the next save (a save
  that never becomes whole resumes from the one before, which needs it). A resume from
  that checkpoint deletes those logs first, named by key (the run's tag and the group
  id: a resumed run numbers its groups on from the checkpoint's, and meets the stopped
  run's numbers), set aside or not (red team 13: the longest log of a task's episode
  index was taken, the trained group's often, and the episode trained twice)."""
  wal = TokenWAL(str(tmp_path))
  for group, episode, turns in (("g0", 0, ["8", "12"]), ("g5", 0, ["8"]), ("g6", 1, ["9"])):
    log = wal.open(f"{group}-{episode}-r0", group_id=group, task=TASK.to_dict(),
                   episode=episode)
    play(ScriptedEngine(turns + ["11"]), log=log)
  # (episode 0 of the task: the longest log, the trained group's)
  assert sorted(r.start["group_id"] for r in wal.pending()) == ["g0", "g6"]
  assert wal.key("g0") != TokenWAL(str(tmp_path)).key("g0")  # (another trainer start)
  resumed = TokenWAL(str(tmp_path))
  assert resumed.forget([wal.key("g0"), resumed.key("g5")]) == 1  # (g5: not this run's)
  assert sorted(r.start["group_id"] for r in resumed.pending()) == ["g5", "g6"]
  (replay,) = [r for r in resumed.pending() if r.start["group_id"] == "g5"]
  assert replay.key == wal.key("g5")
  resumed.set_aside()
  # The resumed run's g0 replays g5 (its log names the logs it replays): its checkpoint
  # lists both keys, and a resume from it forgets both, the aside copy too.
  log = resumed.open("g0-0-r0", group_id="g0", task=TASK.to_dict(), episode=0,
                     replays=replay.keys)
  play(ScriptedEngine(["8", "11"]), log=log)
  again = TokenWAL(str(tmp_path))
  (relogged,) = [r for r in again.pending() if r.start["group_id"] == "g0"]
  assert relogged.keys == {resumed.key("g0"), wal.key("g5")}
  # A second resume's group replays the re-logged episode: every earlier copy's key
  # comes with it (a resume that kept logs aside could hold two generations of it, and
  # the older, never listed, was replayed again: a reviewer's finding).
  assert again.forget(relogged.keys) == 2
  assert [r.start["group_id"] for r in again.pending()] == ["g6"]
  assert again.forget([]) == 0


def test_a_full_disk_is_the_runs_storage_failing_in_one_line(tmp_path):
  """A WAL write on a full disk (/dev/full here) raises RunWriteFailed naming the log and
  the full disk: the run stops with one line, exit 3 (it was an OSError an episode raised,
  stopping the run as "a bug" with its traceback)."""
  wal = TokenWAL(str(tmp_path))
  os.symlink("/dev/full", tmp_path / "g.jsonl")
  with pytest.raises(RunWriteFailed, match=r"the token WAL could not be written in .+ "
                     r"\(No space left on device\); the disk is full: free space there"):
    wal.open("s1", group_id="g", task=TASK.to_dict(), episode=0)


def test_damaged_and_foreign_lines_in_the_wal_are_left_out_not_a_crash(tmp_path):
  """A damaged line, a foreign file's lines or bytes that are not UTF-8 in the WAL's
  directory were a KeyError, an AttributeError or a UnicodeDecodeError at every resume
  (red team 15; a scheduler restarting the job met it each time), and a damaged line in
  the middle of a group's log dropped every record after it, other episodes' too."""
  wal = TokenWAL(str(tmp_path))
  for session, episode in (("s1", 0), ("s2", 1)):
    log = wal.open(session, group_id="g", task=TASK.to_dict(), episode=episode)
    play(ScriptedEngine(["8", "12", "11"]), log=log)
  lines = open(log.path, "rb").read().splitlines(keepends=True)
  # s1's end record damaged; s2's records follow it.
  end1 = next(i for i, line in enumerate(lines)
              if json.loads(line)["kind"] == "end" and json.loads(line)["session"] == "s1")
  lines[end1] = b'{"session": "s1", "ki\xff\n'
  with open(log.path, "wb") as f:
    f.writelines(lines)
  (tmp_path / "foreign.jsonl").write_bytes(b'{"a": 1}\n[1, 2]\n\xff\xfe\n5\n')
  (tmp_path / "latin1.jsonl").write_bytes(b"caf\xe9\n")
  replays = wal.pending()
  assert sorted(r.start["episode"] for r in replays) == [0, 1]
  assert all(len(r) == 3 for r in replays)
  assert wal.forget(["nothing/here"]) == 0


def test_a_log_whose_first_line_is_damaged_is_still_forgotten_by_its_key(tmp_path):
  """`forget` knew a group's log by its first record: with that line damaged the file
  stayed, and its other episodes were replayed, trained twice (reviewer)."""
  wal = TokenWAL(str(tmp_path))
  for session, episode in (("s1", 0), ("s2", 1)):
    log = wal.open(session, group_id="g", task=TASK.to_dict(), episode=episode)
    play(ScriptedEngine(["8", "12", "11"]), log=log)
  raw = bytearray(open(log.path, "rb").read())
  raw[16] = ord("#")
  open(log.path, "wb").write(bytes(raw))
  assert wal.forget([wal.key("g")]) == 1
  assert wal.pending() == []


def test_a_replay_checks_the_rebuilt_prompts_tokens_not_only_their_count(tmp_path):
  """A rebuilt prompt of the logged length but other tokens is refused (its logged
  log-probs were of another context); the logged prompt itself replays. (Tests by
  mutation: a check of the length alone passed.)"""
  wal = TokenWAL(str(tmp_path))
  engine = ScriptedEngine(["8", "11"])
  play(engine, log=wal.open("s1", group_id="g", task=TASK.to_dict(), episode=0))
  prompt = list(engine.prompts[0])
  (replay,) = wal.pending()
  with pytest.raises(ValueError, match="turn 0: the rebuilt prompt differs"):
    replay.next_turn(prompt[:-1] + [prompt[-1] + 1])
  (replay,) = wal.pending()
  assert replay.next_turn(prompt).output_ids


def test_the_wal_syncs_each_record_only_when_asked_and_every_cut(tmp_path, monkeypatch):
  """`checkpoint.wal_fsync` on: every record is on disk before its side effect (an fsync
  a record), and a resume's cut of the logs is synced before it replaces them; off: no
  record waits on the disk. (Tests by mutation: both fsyncs dropped passed.)"""
  synced = []
  monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd))
  for fsync, where in ((True, "on"), (False, "off")):
    synced.clear()
    wal = TokenWAL(str(tmp_path / where), fsync=fsync)
    log = wal.open("s1", group_id="g", task=TASK.to_dict(), episode=0)
    play(ScriptedEngine(["8", "11"]), log=log)
    turns = sum(r["kind"] == "turn" for r in read_log(log.path))
    assert (len(synced) >= turns > 0) if fsync else not synced, (where, synced)
  synced.clear()
  TokenWAL(str(tmp_path / "off"), fsync=False).set_aside(version=4)  # (turns of 5: cut)
  assert len(synced) == 1


def test_a_bare_group_id_forgets_any_runs_log_of_it(tmp_path):
  wal = TokenWAL(str(tmp_path))
  for group in ("g1", "g2"):
    play(ScriptedEngine(["11"]), log=wal.open(f"{group}-0", group_id=group,
                                               task=TASK.to_dict(), episode=int(group[1])))
  assert TokenWAL(str(tmp_path)).forget(["g1"]) == 1
  assert [r.start["group_id"] for r in wal.pending()] == ["g2"]


def test_an_episode_whose_start_is_lost_is_played_again_and_clear_leaves_no_cut(tmp_path):
  """An episode whose start record is damaged (its task and index unknown) is not a
  replay: it is played again. `clear` also removes a cut a crash left half made, and the
  WAL holds no more files open than its limit. (Tests by mutation: each survived.)"""
  wal = TokenWAL(str(tmp_path))
  for session, episode in (("s1", 0), ("s2", 1)):
    play(ScriptedEngine(["8", "11"]), log=wal.open(session, group_id="g",
                                                   task=TASK.to_dict(), episode=episode))
  path = wal._path("g")
  lines = open(path, "rb").read().splitlines(keepends=True)
  start1 = next(i for i, line in enumerate(lines)
                if json.loads(line)["kind"] == "start" and json.loads(line)["session"] == "s1")
  lines[start1] = b"#" + lines[start1]
  open(path, "wb").writelines(lines)
  assert [r.start["episode"] for r in wal.pending()] == [1]
  (tmp_path / "g.jsonl.cut").write_text('{"kind": "start"')
  (tmp_path / "notes.txt").write_text("kept")
  wal.clear()
  assert sorted(os.listdir(tmp_path)) == ["notes.txt"] and wal.pending() == []

  few = TokenWAL(str(tmp_path / "few"))
  few._open.limit = 3
  for i in range(5):
    few.open(f"s{i}", group_id=f"g{i}", task=TASK.to_dict(), episode=i)
    assert len(few._open._held) == min(i + 1, 3)
  assert list(few._open._held) == [few._path(f"g{i}") for i in (2, 3, 4)]
  few.open("s9", group_id="g0", task=TASK.to_dict(), episode=9)  # (reopened, appended)
  assert [r["session"] for r in read_log(few._path("g0"))] == ["s0", "s9"]


def test_a_replay_logs_each_turn_by_its_number_and_goes_on_with_the_logged_seeds(tmp_path):
  """Turn records carry their turn's number; the turns sampled after a replay use the
  seeds of the logged session (the same tokens as the dead run would have sampled), not
  the new session's."""
  from jaxagent.agent import turn_seed

  wal = TokenWAL(str(tmp_path))
  log = wal.open("s1", group_id="g", task=TASK.to_dict(), episode=0)
  first = ScriptedEngine(["8", "12", "11"])
  play(first, log=log)
  records = read_log(log.path)
  assert [r["turn"] for r in records if r["kind"] == "turn"] == [0, 1, 2]
  assert [r["turn"] for r in records if r["kind"] == "obs"] == [0, 1, 2]
  last = [i for i, r in enumerate(records) if r["kind"] == "turn"][1]
  engine = ScriptedEngine(["11"])
  ep = asyncio.run(run_whitebox(make("guess_number"), TASK, engine, TOK, CFG,
                                session_id="another", group_id="g",
                                replay=Replay(records[:last + 1])))
  assert ep.success and ep.replayed_turns == 2 and engine.seeds == [turn_seed("s1", 2)]
  assert engine.seeds == first.seeds[2:]


def test_a_replayed_turn_whose_observation_matches_but_state_differs_is_dropped(tmp_path):
  """Only the state hash tells these apart: the first guess reads "Higher." against
  secret 11 and 12 alike, the environment's state differs."""
  wal = TokenWAL(str(tmp_path))
  log = wal.open("s1", group_id="g", task=TASK.to_dict(), episode=0)
  play(ScriptedEngine(["8", "11"]), log=log)
  records = read_log(log.path)
  first_obs = [i for i, r in enumerate(records) if r["kind"] == "obs"][0]
  other = TaskSpec("t", "guess_number", {"secret": 12, "process_reward": 0.1})
  ep = asyncio.run(run_whitebox(make("guess_number"), other, ScriptedEngine(["12"]), TOK, CFG,
                                session_id="s2", replay=Replay(records[:first_obs + 1])))
  assert ep.infra_error and ep.infra_kind == "wal_replay" and "turn 0" in ep.reason
  same = asyncio.run(run_whitebox(make("guess_number"), TASK, ScriptedEngine(["11"]), TOK, CFG,
                                  session_id="s2", replay=Replay(records[:first_obs + 1])))
  assert same.success and same.replayed_turns == 1 and not same.infra_error


def test_a_resumed_run_numbers_its_groups_past_every_logged_one(tmp_path):
  """A reviewer: the stopped run numbered groups on after its checkpoint (async modes),
  and a replayed episode samples on with its first session's seeds: a fresh group of the
  resumed run given one of those numbers again sampled the same turns (the same task on
  the same weights), and the episode was trained twice. Group numbers go on past every
  group the log holds."""
  from jaxagent.resume import past_logged_groups

  wal = TokenWAL(str(tmp_path))
  for group, session, episode in (("g7", "g7-0-r0", 0), ("g12", "g12-1-r1", 1)):
    log = wal.open(session, group_id=group, task=TASK.to_dict(), episode=episode)
    play(ScriptedEngine(["8", "12", "10", "11"]), log=log)
  replays = wal.pending()
  assert len(replays) == 2
  assert past_logged_groups(5, replays) == 13
  assert past_logged_groups(20, replays) == 20
  assert past_logged_groups(5, []) == 5
