"""The trajectory viewer (`python -m jaxagent.view`): its index, its JSON API in process,
and its page in a real headless Chromium driven by Selenium."""

import gzip
import json
import os
import shutil
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from jaxagent import view
from jaxagent.launch import free_port
from jaxagent.metrics import cut_jsonl
from jaxagent.tokenizer import ENDOFTEXT, IM_END, Tokenizer
from jaxagent.trajectory import TrajectoryManager, TurnRecord, dump_segments, read_jsonl
from tests.conftest import REPO

TOK = Tokenizer.byte_level()
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluates an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'


def turn(messages: list, text: str, response: dict, version: int, tools=None) -> TurnRecord:
  """A turn as the agent records it: the rendered chat in, `text`'s tokens out."""
  out = TOK.encode(text)
  return TurnRecord(prompt_ids=TOK.apply_chat_template(messages, tools), output_ids=out,
                    output_logprobs=[-0.25 - 0.01 * i for i in range(len(out))],
                    versions=[version] * len(out), finish_reason="stop",
                    messages=list(messages), response=response)


def calculator_episode(sid: str, task: str, version: int, answer: str, realign: bool) -> list:
  """A tool call, its result, an answer. With `realign` the call ends in <|endoftext|>,
  which the template re-renders as <|im_end|>: the second turn is a REALIGN."""
  m = TrajectoryManager(sid, task_id=task, group_id=sid.split("-")[0])
  msgs = [{"role": "user", "content": "What is 6 * 7?"}]
  call = {"role": "assistant", "content": "", "tool_calls": [{
      "id": "call_0", "type": "function",
      "function": {"name": "calculator", "arguments": '{"expression": "6 * 7"}'}}]}
  m.add_turn(turn(msgs, CALL + (ENDOFTEXT if realign else IM_END), call, version, TOOLS))
  msgs += [call, {"role": "tool", "content": "42"}]
  m.add_turn(turn(msgs, answer + IM_END, {"role": "assistant", "content": answer}, version,
                  TOOLS))
  good = answer == "42"
  return m.segments(status="completed", reason="", reward=float(good),
                    turn_rewards=[0.0, float(good)],
                    verdict={"status": "pass" if good else "fail", "reward": float(good)})


def guess_episode(sid: str, task: str, version: int, branch: bool, **outcome) -> list:
  """Guesses; the last turn's prompt drops the first exchange (compacted context): a
  FORK. With `branch` a second guess at the second prompt makes a sibling segment."""
  m = TrajectoryManager(sid, task_id=task, group_id=sid.split("-")[0])

  def guess(msgs, number):
    m.add_turn(turn(msgs, number + IM_END, {"role": "assistant", "content": number}, version))
    return msgs + [{"role": "assistant", "content": number}]

  msgs = guess([{"role": "user", "content": "Guess my number, 1 to 16."}], "8")
  msgs += [{"role": "user", "content": "Lower: 1-7."}]
  if branch:
    guess(msgs, "2")
  msgs = guess(msgs, "4") + [{"role": "user", "content": "Higher: 5-7."}]
  guess(msgs[2:], "6")
  return m.segments(**outcome)


def with_advantages(segments: list, value) -> list:
  for s in segments:
    s.advantages = None if value is None else (s.loss_mask * value).astype(np.float32)
    s.meta_versions = TOK.identity()
  return segments


def write_run(run_dir, compress: bool = True) -> str:
  """A run directory as `jaxagent.train` writes it (config.json, trajectories written by
  `dump_segments`, one call a step): six episodes over two steps and policy versions."""
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, "config.json"), "w") as f:
    json.dump({"name": "fixture", "model": {"preset": "nano", "checkpoint": None}}, f)
  path = os.path.join(run_dir, "trajectories.jsonl" + (".gz" if compress else ""))
  for step, segments in ((1, STEP_1), (2, STEP_2)):
    dump_segments(path, [s for make, adv in segments for s in with_advantages(make(), adv)],
                  step, TOK.decode)
  return path


STEP_1 = [
    (lambda: calculator_episode("g0-0-r0", "calculator/0-1", 0, "42", False), 0.5),
    (lambda: calculator_episode("g0-1-r0", "calculator/0-2", 0, "41", True), -0.5),
    (lambda: guess_episode("g1-0-r0", "guess_number/0-7", 0, False, status="truncated",
                           reason="turn_cap", reward=0.0, turn_rewards=[0.0] * 3,
                           verdict={"status": "fail", "reward": 0.0}), -0.25)]
STEP_2 = [
    (lambda: calculator_episode("g2-0-r0", "calculator/0-3", 1, "42", False), 0.75),
    (lambda: guess_episode("g3-0-r0", "guess_number/0-8", 1, True, status="completed",
                           reason="", reward=1.0, turn_rewards=[0.0, 0.0, 0.0, 1.0],
                           verdict={"status": "pass", "reward": 1.0}), 1.0),
    (lambda: guess_episode("g3-1-r0", "guess_number/0-9", 1, False, status="truncated",
                           reason="token_cap", reward=0.0, turn_rewards=[0.0] * 3,
                           verdict={"status": "fail", "reward": 0.0}), None)]


@pytest.fixture
def run_dir(tmp_path):
  write_run(str(tmp_path / "run"))
  return str(tmp_path / "run")


def by_episode(path: str) -> dict:
  out = {}
  for row in read_jsonl(path):
    out.setdefault((row["step"], row["rollout_id"]), []).append(row)
  return out


# -- the index ------------------------------------------------------------------------------


@pytest.mark.parametrize("compress", [True, False])
def test_index_reads_back_every_episode_as_written(tmp_path, monkeypatch, compress):
  # Small reads and a decompressor state saved every 1 KB: reads start inside gzip
  # members, not only at their starts.
  monkeypatch.setattr(view, "CHUNK", 256)
  monkeypatch.setattr(view, "CHECKPOINT_BYTES", 1 << 10)
  path = write_run(str(tmp_path), compress)
  index = view.TrajectoryIndex(path)
  index.refresh()
  if compress:
    assert any(state is not None for _, state in index._lines.marks)
  want = by_episode(path)
  assert [(e["step"], e["rollout_id"]) for e in index.episodes] == list(want)
  for e in index.episodes:
    assert index.episode(e["n"])[1] == want[(e["step"], e["rollout_id"])]
  assert index.episode(len(want)) is None
  # A resumed run rewrites the file as one member: the index starts over and still reads.
  cut_jsonl(path, 1)
  assert [e["step"] for e in index.select()] == [1, 1, 1]
  for e in index.episodes:
    assert index.episode(e["n"])[1] == want[(e["step"], e["rollout_id"])]


def test_decompressor_states_are_saved_every_checkpoint_of_output(tmp_path, monkeypatch):
  """Red team 24: a state was saved at most once a read chunk of compressed input, so a
  chunk of very compressible lines (64 KB into 16 MB) put them 16 MB apart, where 4 MB
  was meant: each episode's read decompressed that much again."""
  import gzip

  monkeypatch.setattr(view, "CHECKPOINT_BYTES", 4 << 10)
  path = str(tmp_path / "trajectories.jsonl.gz")
  row = json.dumps({"step": 1, "rollout_id": "r", "text": "a" * 200_000}) + "\n"
  with gzip.open(path, "wt") as f:
    f.write(row * 8)
  lines = view.GzipLines(path)
  with open(path, "rb") as f:
    assert sum(1 for _ in lines.scan(f)) == 8
  gaps = [b - a for a, b in zip(lines.mark_offsets, lines.mark_offsets[1:])]
  assert gaps and max(gaps) <= 2 * (4 << 10), max(gaps)
  assert lines.read(len(row) * 5, len(row)) == row.encode()


def test_index_follows_a_growing_file_and_stops_at_damage(tmp_path):
  path = str(tmp_path / "trajectories.jsonl")
  dump_segments(path, with_advantages(STEP_1[0][0](), 0.5), 1, TOK.decode)
  with open(path) as f:
    line = f.read()
  with open(path, "a") as f:  # a line still being written is not read yet
    f.write(line[:40])
  index = view.TrajectoryIndex(path)
  assert len(index.select()) == 1
  with open(path, "a") as f:
    f.write(line[40:].replace("g0-0-r0", "g9-0-r0"))
  assert [e["rollout_id"] for e in index.select()] == ["g0-0-r0", "g9-0-r0"]

  gz = str(tmp_path / "trajectories.jsonl.gz")
  dump_segments(gz, with_advantages(STEP_1[0][0](), 0.5), 1, TOK.decode)
  index = view.TrajectoryIndex(gz)
  assert len(index.select()) == 1 and index.facets()["complete"]
  member = gzip.compress(line.replace("g0-0-r0", "g9-0-r0").encode())
  with open(gz, "ab") as f:  # a member half written: read on when the rest comes
    f.write(member[:len(member) // 2])
  assert len(index.select()) == 1
  with open(gz, "ab") as f:
    f.write(member[len(member) // 2:])
  assert [e["rollout_id"] for e in index.select()] == ["g0-0-r0", "g9-0-r0"]
  assert index.episode(1)[1][0]["rollout_id"] == "g9-0-r0"
  with open(gz, "ab") as f:  # a member cut short by a kill, then more appended
    f.write(gzip.compress(line.encode())[:30])
  dump_segments(gz, with_advantages(STEP_1[1][0](), 0.5), 2, TOK.decode)
  assert len(index.select()) == 2 and not index.facets()["complete"]
  assert index.episode(0)[1][0]["rollout_id"] == "g0-0-r0"


def test_lines_that_are_not_segments_are_counted_not_fatal(tmp_path):
  """Red team 14: a line nested 5,000 deep, a string step beside integer ones, a task id
  that is a number, a reward that is text or an integer past 4,300 digits stopped the
  viewer at its start or broke its filters (500s) for good: each is a bad line."""
  path = str(tmp_path / "trajectories.jsonl")
  dump_segments(path, with_advantages(STEP_1[0][0](), 0.5), 1, TOK.decode)
  with open(path) as f:
    good = json.loads(f.readline())
  bad = ["[" * 5000 + "]" * 5000, json.dumps({**good, "step": "x"}),
         json.dumps({**good, "task_id": 5}), json.dumps({**good, "reward": "high"}),
         json.dumps({**good, "verdict": {"status": 3}}), json.dumps([1, 2]),
         json.dumps(good).replace('"step": 1', '"step": ' + "9" * 5000),
         # (red team 24: each of these answered its episode with a 500, or broke the page)
         json.dumps({k: v for k, v in good.items() if k != "turn_ids"}),
         json.dumps({**good, "segment_id": ["a"]}), json.dumps({**good, "tokens": ["a"]}),
         json.dumps({**good, "tokens": [2**40] * len(good["tokens"])}),
         json.dumps({**good, "turn_rewards": {"a": 1}}), json.dumps({**good, "decisions": [1]}),
         json.dumps({**good, "rollout_logp": good["rollout_logp"][:-1]})]
  with open(path, "a") as f:
    f.write("".join(line + "\n" for line in bad))
  index = view.TrajectoryIndex(path)
  assert len(index.select(task="t", min_reward=0.1)) + len(index.select()) >= 1
  facets = index.facets()
  assert facets["episodes"] == 1 and facets["bad_lines"] == len(bad) and facets["last_step"] == 1


# -- the API in process ---------------------------------------------------------------------


def test_api_lists_filters_and_shows_an_episode(run_dir):
  client = TestClient(view.create_app(run_dir), base_url="http://localhost")
  run = client.get("/api/run").json()
  assert (run["episodes"], run["segments"], run["verdicts"], run["truncations"],
          run["versions"], run["last_step"]) == (6, 10, ["fail", "pass"],
                                                  ["token_cap", "turn_cap"], [0, 1], 2)
  assert run["tokenizer"] == "tokens decoded with the bytes tokenizer"

  def tasks(**q):
    return [e["task_id"] for e in client.get("/api/episodes", params=q).json()["episodes"]]

  assert len(tasks()) == 6
  assert tasks(verdict="pass") == ["calculator/0-1", "calculator/0-3", "guess_number/0-8"]
  assert tasks(task="GUESS", min_reward=0.5) == ["guess_number/0-8"]
  assert tasks(version=0) == ["calculator/0-1", "calculator/0-2", "guess_number/0-7"]
  assert tasks(truncation="token_cap") == ["guess_number/0-9"]
  assert tasks(truncation="any") == ["guess_number/0-7", "guess_number/0-9"]
  assert len(tasks(truncation="none")) == 4
  assert tasks(offset=4, limit=1) == ["guess_number/0-8"]
  assert client.get("/api/episodes/6").status_code == 404
  assert client.get("/api/episodes", params={"limit": 0}).status_code == 422
  for bad in ("nan", "inf", "-inf", "x"):  # (nan matched every episode: a new user)
    assert client.get("/api/episodes", params={"min_reward": bad}).status_code == 422, bad

  # The calculator episode: a tool call, its observation, the answer.
  ep = client.get("/api/episodes/0").json()
  assert ep["verdict"]["status"] == "pass" and ep["summary"]["reward"] == 1.0
  (seg,) = ep["segments"]
  t = seg["tokens"]
  assert "".join(t["text"]) == seg["text"]  # every token's text, in order
  call, answer = seg["turns"]
  assert call["tool_calls"] == [{"name": "calculator", "arguments": {"expression": "6 * 7"}}]
  assert "<|im_start|>tool\n42<|im_end|>" in answer["context"] and answer["action"] == "42<|im_end|>"
  assert [call["decision"], answer["decision"]] == ["clean", "clean"]
  i = t["mask"].index(1)  # the first trained token: the call's first, log-prob as sampled
  assert (t["role"][i], t["chat"][i], t["logp"][i], t["adv"][i], t["version"][i]) == (
      "action", "assistant", -0.25, 0.5, 0)
  assert t["role"][0] == "prompt" and t["logp"][0] is None and t["adv"][0] is None
  assert "observation" in t["role"] and "tool" in t["chat"]

  realign = client.get("/api/episodes/1").json()["segments"][0]
  assert realign["decisions"] == ["clean", "realign"]
  fork = client.get("/api/episodes/2").json()
  assert [n["decisions"] for n in fork["tree"]] == [["clean", "clean"]]
  assert fork["tree"][0]["children"][0]["decisions"] == ["fork"]
  (root,) = client.get("/api/episodes/4").json()["tree"]  # a sibling, then a compaction
  (sibling,) = root["children"]
  assert sibling["decisions"] == ["fork", "clean"]
  assert [c["decisions"] for c in sibling["children"]] == [["fork"]]
  unrecorded = client.get("/api/episodes/5").json()["segments"][0]
  assert not unrecorded["advantages_recorded"] and unrecorded["tokens"]["adv"] is None
  assert client.get("/").text.startswith("<!doctype html>")


def test_a_value_json_has_not_is_null_and_other_hosts_are_refused(tmp_path):
  """Red team 24: one NaN reward (or a -inf log-prob) in the file answered every list
  holding it with a 500, a blank page; any Host header was served (a web page that
  rebinds its name to this machine could read the run), and the API's docs were up."""
  path = str(tmp_path / "trajectories.jsonl")
  dump_segments(path, with_advantages(STEP_1[0][0](), 0.5), 1, TOK.decode)
  with open(path) as f:
    good = json.loads(f.readline())
  logp = [float("-inf")] + good["rollout_logp"][1:]
  with open(path, "a") as f:
    f.write(json.dumps({**good, "rollout_id": "nan", "reward": float("nan"),
                        "rollout_logp": logp, "loss_mask": [1.0] * len(logp)}) + "\n")
  client = TestClient(view.create_app(str(tmp_path)), base_url="http://localhost")
  listed = client.get("/api/episodes")
  assert listed.status_code == 200, listed.text
  (nan,) = [e for e in listed.json()["episodes"] if e["rollout_id"] == "nan"]
  assert nan["reward"] is None
  shown = client.get(f"/api/episodes/{nan['n']}")
  assert shown.status_code == 200 and shown.json()["segments"][0]["tokens"]["logp"][0] is None
  assert TestClient(client.app, base_url="http://attacker.example").get(
      "/api/run").status_code == 400
  allowed = view.create_app(str(tmp_path), hosts=["proxy.example"])  # (--allow-host)
  assert TestClient(allowed, base_url="http://proxy.example").get("/api/run").status_code == 200
  assert client.get("/api/run").status_code == 200
  assert client.get("/docs").status_code == 404 and client.get("/openapi.json").status_code == 404


def test_without_trajectories_one_line_and_exit_2(tmp_path, capsys):
  assert view.main([str(tmp_path)]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and str(tmp_path) in err and "trajectories.jsonl" in err
  assert view.main([str(tmp_path / "typo")]) == 2  # (it said "no trajectories" in it)
  assert capsys.readouterr().err == f"error: no such run directory or file {tmp_path / 'typo'}\n"
  # A file of no segment at all, or not gzip where it says so: not served as "0 episodes"
  # (a red team)
  (tmp_path / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\nme:x:1:1::/:/bin/sh\n")
  (tmp_path / "noise.jsonl.gz").write_bytes(bytes(range(256)) * 2)
  for name, said in (("passwd", "none of its 2 lines is a segment"), ("noise.jsonl.gz",
                                                                      "not gzip")):
    assert view.main([str(tmp_path / name), "--port", str(free_port())]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / name} is not a trajectory file "
                                       f"({said})\n")


# -- the page in a real browser -------------------------------------------------------------


def chrome():
  """A headless Chromium from the Debian packages (chromium, chromium-driver) under
  Selenium; the test skips without them, but fails under CI (.ci/run installs them)."""
  binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
  try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
  except ImportError:
    webdriver = None
  if not (binary and driver and webdriver):
    why = ("the browser test needs Chromium and its driver (apt-get install chromium "
           "chromium-driver) and selenium (pip install -e '.[test]')")
    if os.environ.get("CI"):
      pytest.fail(why)
    pytest.skip(why)
  options = webdriver.ChromeOptions()
  options.binary_location = binary
  for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
              "--window-size=1400,1000"):
    options.add_argument(arg)
  # The driver's own path: Selenium Manager downloads nothing.
  return webdriver.Chrome(service=Service(executable_path=driver), options=options)


def test_page_in_headless_chromium(run_dir, tmp_path, record_property):
  from selenium.webdriver.common.action_chains import ActionChains
  from selenium.webdriver.common.by import By
  from selenium.webdriver.support.ui import Select, WebDriverWait

  driver = chrome()
  port = free_port()
  proc = subprocess.Popen([sys.executable, "-m", "jaxagent.view", run_dir, "--port", str(port)],
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  url = f"http://127.0.0.1:{port}/"
  try:
    deadline = time.time() + 30
    while True:
      try:
        if httpx.get(url + "api/run", timeout=2).status_code == 200:
          break
      except httpx.HTTPError:
        pass
      assert proc.poll() is None and time.time() < deadline, proc.stdout.read()
      time.sleep(0.1)
    wait = WebDriverWait(driver, 10)
    driver.get(url)
    rows = "#episodes tbody tr"
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, rows)) == 6)

    Select(driver.find_element(By.ID, "f-verdict")).select_by_value("pass")
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, rows)) == 3)
    assert [r.find_elements(By.TAG_NAME, "td")[2].text
            for r in driver.find_elements(By.CSS_SELECTOR, rows)] == [
                "calculator/0-1", "calculator/0-3", "guess_number/0-8"]

    driver.find_elements(By.CSS_SELECTOR, rows)[0].click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#tokens .tok.trained"))
    token = driver.find_elements(By.CSS_SELECTOR, "#tokens .tok.trained")[0]
    ActionChains(driver).move_to_element(token).perform()
    hover = driver.find_element(By.ID, "hover")
    wait.until(lambda d: hover.is_displayed())
    assert "log-prob: -0.2500" in hover.text and "advantage: 0.5000" in hover.text
    assert "policy version: 0" in hover.text
    assert "calculator(" in driver.find_element(By.CSS_SELECTOR, ".call").text

    # An episode that cannot be shown says why where it would be (the last one shown
    # stayed, under the new one's number: red team 24).
    driver.get(url + "#episode=99")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#right .fail"))
    assert driver.find_element(By.CSS_SELECTOR, "#right .fail").text == "404: no episode 99"

    shot = str(tmp_path / "view.png")
    driver.save_screenshot(shot)
    record_property("screenshot", shot)
    print(f"screenshot: {shot}")
  finally:
    driver.quit()
    proc.terminate()
    proc.wait(timeout=15)
