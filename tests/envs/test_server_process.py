"""The environment worker as a process of its own (`python -m envs.server`): what it says
at start, what it leaves at a stop, and many episodes at once."""

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.envs.worker_process import start_worker, worker_log

from envs.base import TaskSpec
from envs.isolation import available_isolations
from envs.server import RemoteEnv

needs_isolation = pytest.mark.skipif(available_isolations() == ("rlimits",),
                                     reason="python_tests needs sandbox isolation")


def _mounts_under(root):
  with open("/proc/self/mounts") as f:
    return [l.split()[1] for l in f if l.split()[1].startswith(root)]


@needs_isolation
def test_sigterm_removes_every_workspace(tmp_path):
  proc, url, root = start_worker(tmp_path, "--sandboxes", "2")
  try:
    for i in range(3):
      r = httpx.post(f"{url}/sessions", json={"task": {
          "id": f"p{i}", "env": "python_tests", "params": {"task": "add"}}}, timeout=30)
      assert r.status_code == 200, r.text
    assert len(os.listdir(root)) >= 3
  finally:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
  out = worker_log(proc)
  # (143: a service's SIGTERM is its exit 128 + 15 with its exit handlers run; uvicorn
  # raised it again into the default handler: killed, its lock file left)
  assert proc.returncode == 128 + signal.SIGTERM, out
  assert "sandbox isolation" in out
  assert not os.path.exists(root) and not _mounts_under(root)


@needs_isolation
@pytest.mark.parametrize("choice, says", [("own", "a tmpfs held in a user namespace"),
                                          ("disk", "the host's disk, watched")])
def test_a_worker_not_run_as_root_says_what_its_workspaces_are_on(tmp_path, choice, says):
  """`--workspace-filesystem`: a worker that is not root holds each workspace's tmpfs in
  a user namespace of its own (own; auto where the kernel allows it) or bounds a folder
  on the host's disk by watching each command (disk), and its first line says which."""
  from tests.envs.test_sandbox import skip_unless_nobody_runs_python

  skip_unless_nobody_runs_python()
  proc, url, root = start_worker(tmp_path, "--sandboxes", "1", "--workspace-filesystem",
                                 choice, user=65534)
  try:
    r = httpx.post(f"{url}/sessions", json={"task": {
        "id": "p", "env": "python_tests", "params": {"task": "add"}}}, timeout=30)
    assert r.status_code == 200, r.text + worker_log(proc)
    sid = r.json()["session_id"]
    r = httpx.post(f"{url}/sessions/{sid}/step", timeout=60, json={
        "action": '<tool_call>{"name": "run_python", "arguments": {"code": "import '
                  'subprocess; subprocess.run([\'df\', \'.\'])"}}</tool_call>'})
    assert r.status_code == 200, r.text
    shown = json.dumps(r.json())
    assert ("jaxagent-ws" in shown) == (choice == "own"), shown
  finally:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
  out = worker_log(proc)
  assert f"each on {says} of 32 MiB" in out, out
  assert not os.path.exists(root)


def test_a_worker_stopped_while_a_tool_blocks_for_ever_ends(tmp_path):
  """A tool thread that never returns was joined by Python's exit for ever: the worker
  outlived its Ctrl-C. It is left behind, said, and the worker ends (a SIGTERM ends it
  too: uvicorn raises that signal again once it has shut down)."""
  module = tmp_path / "blocking_env.py"
  module.write_text(
      "import time\n"
      "from envs import base\n"
      "from envs.tools import Tool, ToolSet\n\n"
      "@base.register('blocks_for_ever')\n"
      "class BlocksForEver(base.Env):\n"
      "  async def reset(self, task):\n"
      "    self.tools = ToolSet([Tool('wait', 'waits', {'type': 'object'},\n"
      "                               lambda: time.sleep(3600))])\n"
      "    return base.Observation([{'role': 'user', 'content': 'go'}])\n\n"
      "  async def step(self, action):\n"
      "    run = await self.tools.run_turn(self, action)\n"
      "    return base.StepResult(base.Observation(run.messages), 0.0, False, False)\n\n"
      "  async def verify(self):\n"
      "    return base.Verdict('fail', 0.0, 'b@1', 'b@1')\n")
  proc, url, _ = start_worker(tmp_path, "--sandboxes", "1", "--deadline-s", "1",
                              "--allow-unisolated", "--import", str(module))
  try:
    sid = httpx.post(f"{url}/sessions", json={"task": {"id": "b", "env": "blocks_for_ever"}},
                     timeout=30).json()["session_id"]
    r = httpx.post(f"{url}/sessions/{sid}/step", timeout=30, json={
        "action": '<tool_call>{"name": "wait", "arguments": {}}</tool_call>'})
    assert r.status_code == 504, r.text
  finally:
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
  out = worker_log(proc)
  assert "envs.server: 1 calls (a tool's, an environment's) still running at the end; " \
      "left behind" in out, out
  assert proc.returncode == 130, out


@pytest.mark.slow
@needs_isolation
def test_200_concurrent_python_tests_episodes_all_end_with_a_verdict(tmp_path):
  """The acceptance load: 200 episodes at once against `--sandboxes 8`."""
  from envs.play import play_episode
  from envs.python_tasks_data import TASKS, _function_name

  proc, url, root = start_worker(tmp_path, "--sandboxes", "8")
  solutions = {t[0]: t[2] for t in TASKS}

  def actions(i, name):
    fn = solutions[name]
    wrong = f"\n\ndef {_function_name(fn)}(*a):\n    return 'wrong'\n" + (
        "raise SystemExit(3)\n" if i % 2 else "")
    content = fn if i % 3 else fn + wrong
    call = json.dumps({"name": "write_file",
                       "arguments": {"path": "solution.py", "content": content}})
    return [f"<tool_call>{call}</tool_call>", "DONE"]

  async def one(i):
    name = TASKS[i % len(TASKS)][0]
    script = actions(i, name)
    return await play_episode(RemoteEnv(url, timeout_s=300),
                              TaskSpec(f"python_tests/{name}", "python_tests", {"task": name}),
                              lambda turn: script[turn] if turn < len(script) else None)

  async def go():
    return await asyncio.gather(*(one(i) for i in range(200)), return_exceptions=True)

  try:
    t0 = time.perf_counter()
    results = asyncio.run(go())
    wall = time.perf_counter() - t0
  finally:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
  errors = [r for r in results if isinstance(r, BaseException)]
  assert not errors, errors[:3]
  statuses = [r["verdict"]["status"] for r in results]
  assert set(statuses) <= {"pass", "fail", "timeout"}, statuses
  assert statuses.count("pass") == 133 and statuses.count("fail") == 67, (statuses, wall)
  assert not os.path.exists(root)


def test_a_bad_number_on_the_command_line_names_its_flag():
  """(`--sandboxes 0` said "pool size must be >= 1, got 0", naming no flag: a new user)"""
  import subprocess
  import sys

  from tests.conftest import REPO

  for args, said in ((["--sandboxes", "0"], "argument --sandboxes: must be >= 1, got 0"),
                     (["--deadline-s", "-1"], "argument --deadline-s: must be a number > 0")):
    r = subprocess.run([sys.executable, "-m", "envs.server", *args], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and said in r.stderr.splitlines()[-1], r.stderr
