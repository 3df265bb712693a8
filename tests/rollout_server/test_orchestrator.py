import dataclasses
import threading
import time

import numpy as np
import pytest

from rollout_server.engine import SamplingParams
from rollout_server.orchestrator import Orchestrator, PromptTooLong, QueueFull, Request, continuation
from tests.rollout_server.conftest import make_engine


@pytest.fixture
def orch(random_params):
  engine = make_engine()
  o = Orchestrator(engine, engine.load_params(random_params, version=1)).start()
  yield o
  o.stop()


def test_continuous_batching_more_requests_than_slots(orch):
  reqs = [orch.submit([1 + i, 2, 3], SamplingParams(seed=i, max_new_tokens=5 + 3 * i))
          for i in range(10)]
  assert all(r.wait(120) for r in reqs)
  assert [len(r.output_ids) for r in reqs] == [5 + 3 * i for i in range(10)]
  assert all(r.finish_reason == "length" for r in reqs)
  s = orch.stats()
  assert s["live_slots"] == 0 and s["queue"] == 0 and s["requests_finished"] == 10
  # Slots were shared: fewer decode steps than the sum of the outputs.
  assert s["steps"] < sum(len(r.output_ids) for r in reqs)


def test_same_seed_same_result_alone_or_among_others(orch):
  alone = orch.generate([5, 6, 7, 8], SamplingParams(seed=42, max_new_tokens=16), timeout=60)
  others = [orch.submit([9, i], SamplingParams(seed=i, max_new_tokens=4 + i)) for i in range(3)]
  crowd = orch.submit([5, 6, 7, 8], SamplingParams(seed=42, max_new_tokens=16))
  more = [orch.submit([11, i], SamplingParams(seed=i, max_new_tokens=9)) for i in range(3)]
  for r in others + more + [crowd]:
    r.wait(60)
  assert crowd.output_ids == alone.output_ids
  assert crowd.output_logprobs == alone.output_logprobs


def test_stop_tokens_end_a_request(orch):
  probe = orch.generate([1, 2], SamplingParams(seed=3, max_new_tokens=10), timeout=60)
  stop = probe.output_ids[4]
  r = orch.generate([1, 2], SamplingParams(seed=3, max_new_tokens=10, stop_token_ids=(stop,)),
                    timeout=60)
  assert r.finish_reason == "stop" and r.output_ids[-1] == stop
  assert r.output_ids == probe.output_ids[:probe.output_ids.index(stop) + 1]


def test_abort_returns_partial_output_and_frees_the_slot(orch):
  r = orch.submit([1, 2, 3], SamplingParams(seed=1, max_new_tokens=300))
  while len(r.output_ids) < 3:
    time.sleep(0.01)
  assert orch.abort(r.request_id)
  assert r.wait(30) and r.finish_reason == "abort"
  assert 3 <= len(r.output_ids) < 300
  assert orch.stats()["live_slots"] == 0
  assert not orch.abort("no-such-request")
  # Resuming continues from the partial output.
  prompt, sampling, resumed = continuation(r)
  assert prompt == r.prompt_ids + r.output_ids and sampling.max_new_tokens == 300 - len(
      r.output_ids) and resumed == len(r.output_ids)


def test_weight_update_drain_and_abort(random_params):
  engine = make_engine()
  orch = Orchestrator(engine, engine.load_params(random_params, version=1)).start()
  try:
    before = orch.generate([4, 4, 4], SamplingParams(seed=0, max_new_tokens=12), timeout=60)
    assert set(before.versions) == {1}
    new = {k: v * 1.5 for k, v in random_params.items()}
    # drain: the running request finishes on version 1.
    running = orch.submit([4, 4, 4], SamplingParams(seed=0, max_new_tokens=40))
    while not running.output_ids:
      time.sleep(0.005)
    report = orch.update_weights(engine.load_params(new, version=2), mode="drain")
    assert running.done and running.finish_reason == "length" and set(running.versions) == {1}
    assert report["version"] == 2 and report["in_flight"] == 1 and report["paused_s"] >= 0
    after = orch.generate([4, 4, 4], SamplingParams(seed=0, max_new_tokens=12), timeout=60)
    assert set(after.versions) == {2} and after.output_ids != before.output_ids
    # abort: a running request comes back partial, stamped with the old version.
    running = orch.submit([4, 4, 4], SamplingParams(seed=0, max_new_tokens=300))
    while len(running.output_ids) < 2:
      time.sleep(0.005)
    report = orch.update_weights(engine.load_params(random_params, version=3), mode="abort")
    assert running.finish_reason == "abort" and set(running.versions) == {2}
    assert running.abort_cause == "weight_update"  # (resumable; an explicit abort's is None)
    prompt, sampling, n = continuation(running)
    resumed = orch.generate(prompt, sampling, timeout=120, resumed_tokens=n)
    assert set(resumed.versions) == {3} and resumed.finish_reason == "length"
    assert orch.stats()["last_swap"]["version"] == 3
  finally:
    orch.stop()


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_requests_run_to_the_caches_end_with_exact_log_probs(random_params, decode_steps):
  """Requests whose budget passes the cache (no stop token) end as `length` with the cache
  full, every token's log-prob the full forward pass's (a clamp of the decode position
  two short of the end passed every engine test: red team 36's mutation, whose requests
  never finished)."""
  engine = make_engine(max_concurrent_decodes=4, max_prefill_length=64, max_seq_len=64,
                       page_size=8)
  params = engine.load_params(random_params, version=0)
  orch = Orchestrator(engine, params, prefix_cache_tokens=128,
                      decode_steps=decode_steps).start()
  try:
    reqs = [orch.submit(list(range(5, 5 + n)), SamplingParams(seed=n, max_new_tokens=100))
            for n in (40, 57, 63, 1, 30)]
    for r in reqs:
      assert r.wait(60), f"a {len(r.prompt_ids)}-token prompt's request did not finish"
      seq = r.prompt_ids + r.output_ids
      assert r.finish_reason == "length" and len(seq) == 64, (r.finish_reason, len(seq))
      fresh = engine.score(params, [seq])[0][len(r.prompt_ids):]
      np.testing.assert_allclose(r.raw_logprobs, fresh, atol=1e-4)
  finally:
    orch.stop()


@pytest.mark.parametrize("mode", ["drain", "abort"])
def test_a_weight_update_drops_the_prefix_cache(random_params, mode):
  """KV cached under the old weights is never reused under the new: a turn continuing a
  prompt cached before the update is prefilled anew, and its log-probs are the new
  weights' (with the cache kept, they were off by up to 0.85: red team 36's mutation,
  which every rollout-server test passed)."""
  engine = make_engine(max_concurrent_decodes=4, max_prefill_length=64, max_seq_len=96,
                       page_size=8)
  orch = Orchestrator(engine, engine.load_params(random_params, version=1),
                      prefix_cache_tokens=256).start()
  try:
    prompt = list(range(3, 40))
    first = orch.generate(prompt, SamplingParams(seed=1, max_new_tokens=20), timeout=60)
    again = orch.generate(prompt + [7], SamplingParams(seed=2, max_new_tokens=4), timeout=60)
    assert again.prefix_hit_tokens > 0  # (cached under version 1)
    new = engine.load_params({k: v * 1.5 for k, v in random_params.items()}, version=2)
    orch.update_weights(new, mode=mode)
    # (the second shares the first's prompt, cached again now: under version 2)
    for i, cont in enumerate((prompt + [7], first.prompt_ids + first.output_ids + [9, 9])):
      r = orch.generate(cont, SamplingParams(seed=3, max_new_tokens=10), timeout=60)
      assert (r.prefix_hit_tokens == 0) == (i == 0) and set(r.versions) == {2}
      fresh = engine.score(new, [r.prompt_ids + r.output_ids])[0][len(r.prompt_ids):]
      np.testing.assert_allclose(r.raw_logprobs, fresh, atol=1e-4)
  finally:
    orch.stop()


@pytest.mark.slow
def test_a_cut_turn_resumes_past_max_prefill_length(random_params):
  """A turn whose prompt is near `max_prefill_length`, cut by a weight update in abort
  mode, resumes with its prompt plus the tokens it sampled: past `max_prefill_length`
  (up to `max_seq_len`), which the prompt limit does not count (red-team round 4: the
  turn was refused and re-rolled as infrastructure). Its tokens are those an engine that
  takes the whole continuation in one prefill samples."""
  engine = make_engine(max_prefill_length=64, max_seq_len=160)
  orch = Orchestrator(engine, engine.load_params(random_params, version=1)).start()
  try:
    running = orch.submit(list(range(1, 61)), SamplingParams(seed=5, max_new_tokens=80))
    while len(running.output_ids) < 12:
      time.sleep(0.005)
    scaled = {k: v * 1.5 for k, v in random_params.items()}
    orch.update_weights(engine.load_params(scaled, version=2), mode="abort")
    assert running.finish_reason == "abort" and running.abort_cause == "weight_update"
    prompt, sampling, n = continuation(running)
    assert len(prompt) > 64 and n == len(running.output_ids)
    with pytest.raises(ValueError, match="max_prefill_length"):
      orch.submit(prompt, sampling)  # as a new prompt it is too long
    resumed = orch.generate(prompt, sampling, timeout=120, resumed_tokens=n)
    assert resumed.finish_reason == "length" and set(resumed.versions) == {2}
    assert len(resumed.output_ids) == 80 - n
    with pytest.raises(ValueError, match="resumed_tokens"):
      orch.submit(prompt, sampling, resumed_tokens=len(prompt))
    with pytest.raises(ValueError, match="max_prefill_length"):  # the prompt is still bound
      orch.submit(list(range(1, 71)) + [1] * 4, sampling, resumed_tokens=4)
    with pytest.raises(ValueError, match="max_seq_len"):
      orch.submit(list(range(1, 61)) + [1] * 100, sampling, resumed_tokens=100)
  finally:
    orch.stop()
  whole = make_engine(max_prefill_length=160, max_seq_len=160)
  ref = Orchestrator(whole, whole.load_params(scaled, version=2)).start()
  try:
    one = ref.generate(prompt, sampling, timeout=120)
  finally:
    ref.stop()
  assert one.output_ids == resumed.output_ids
  np.testing.assert_allclose(one.output_logprobs, resumed.output_logprobs, atol=2e-5)


def test_bad_requests_fail_alone(orch):
  with pytest.raises(ValueError, match="vocabulary"):
    orch.submit([1, 99999])
  with pytest.raises(ValueError, match="empty"):
    orch.submit([])
  with pytest.raises(ValueError, match="max_prefill_length"):
    orch.submit([1] * 600)
  with pytest.raises(ValueError, match="temperature"):
    orch.submit([1], SamplingParams(temperature=-1))
  ok = orch.generate([1, 2], SamplingParams(max_new_tokens=3), timeout=60)
  assert ok.finish_reason == "length"


def test_queue_limit(random_params):
  engine = make_engine()
  orch = Orchestrator(engine, engine.load_params(random_params), max_queue=2)  # not started
  orch.submit([1])
  orch.submit([2])
  with pytest.raises(QueueFull):
    orch.submit([3])
  orch.stop()


def test_long_prompts_are_prefilled_in_chunks_between_decode_steps(random_params):
  """A prompt prefilled 16 tokens a call decodes as one prefilled whole; a request already
  decoding keeps stepping while the long prompt's chunks go in."""
  prompt = list(range(1, 121))
  whole_engine = make_engine(page_size=8)
  whole = Orchestrator(whole_engine, whole_engine.load_params(random_params)).start()
  want = whole.generate(prompt, SamplingParams(seed=3, max_new_tokens=8), timeout=120)
  whole.stop()
  engine = make_engine(page_size=8)
  orch = Orchestrator(engine, engine.load_params(random_params), prefill_chunk=16).start()
  try:
    runner = orch.submit([5, 6, 7], SamplingParams(seed=1, max_new_tokens=400))
    while not runner.output_ids:
      time.sleep(0.001)
    steps_before = orch.stats()["steps"]
    got = orch.generate(prompt, SamplingParams(seed=3, max_new_tokens=8), timeout=120)
    s = orch.stats()
  finally:
    orch.stop()
  assert got.output_ids == want.output_ids
  np.testing.assert_allclose(got.output_logprobs, want.output_logprobs, atol=1e-5)
  assert s["prefill_calls"] >= 1 + 120 // 16
  assert s["steps"] - steps_before >= 120 // 16  # decode steps ran between the chunks


def test_requests_wait_for_pages_and_all_finish(random_params):
  """A pool with room for two sequences at a time: the rest queue until pages return."""
  engine = make_engine(page_size=8, num_pages=1 + 2 * 5)
  orch = Orchestrator(engine, engine.load_params(random_params)).start()
  try:
    reqs = [orch.submit([1 + i, 2, 3], SamplingParams(seed=i, max_new_tokens=30))
            for i in range(6)]
    peak = 0
    while not all(r.done for r in reqs):
      peak = max(peak, orch.stats()["live_slots"])
      time.sleep(0.002)
    s = orch.stats()
  finally:
    orch.stop()
  assert all(r.finish_reason == "length" and len(r.output_ids) == 30 for r in reqs)
  assert peak <= 2 and s["kv_pages"]["used"] == 0
  idle = Orchestrator(engine, engine.load_params(random_params))
  with pytest.raises(ValueError, match="max_new_tokens 200 alone needs more KV pages"):
    idle.submit([1], SamplingParams(max_new_tokens=200))
  # A prompt that outgrew the pool is too long (the policy's or a judge's own length,
  # as over max_prefill_length), not a server error (a judge's fail became a re-roll).
  with pytest.raises(PromptTooLong, match="prompt is too long: with max_new_tokens it needs"):
    idle.submit(list(range(1, 60)), SamplingParams(max_new_tokens=30))


def test_abort_and_weight_update_while_a_prompt_is_prefilled_in_chunks(random_params):
  engine = make_engine(page_size=8)
  orch = Orchestrator(engine, engine.load_params(random_params, version=1),
                      prefill_chunk=16).start()
  try:
    long_prompt = [1 + i % 300 for i in range(399)]
    # Answers long enough that they cannot end before the abort or the update does (a
    # busy machine can hold this thread back while the engine runs; 5 tokens could end).
    r = orch.submit(long_prompt, SamplingParams(seed=1, max_new_tokens=200))
    orch.abort(r.request_id)
    assert r.wait(60) and r.finish_reason == "abort"
    new_params = engine.load_params(random_params, version=2)  # placed before the race
    r = orch.submit(long_prompt, SamplingParams(seed=1, max_new_tokens=240))
    deadline = time.monotonic() + 60
    while r.slot is None and not r.done and time.monotonic() < deadline:
      time.sleep(0.001)  # admitted (a queued request would wait and run on the new weights)
    report = orch.update_weights(new_params, mode="abort")
    assert r.wait(60) and r.finish_reason == "abort" and report["version"] == 2
    ok = orch.generate(long_prompt, SamplingParams(seed=1, max_new_tokens=5), timeout=120)
    assert ok.finish_reason == "length" and set(ok.versions) == {2}
    assert orch.stats()["kv_pages"]["used"] == 0
  finally:
    orch.stop()


def test_length_aware_admission_probes_then_runs_longest_first(random_params):
  """Each prompt's first sample runs as a probe and its siblings wait for it; once lengths
  are known, queued requests start longest-expected first."""
  engine = make_engine()  # 4 slots
  orch = Orchestrator(engine, engine.load_params(random_params), length_aware=True).start()
  lengths = {0: 4, 1: 40, 2: 12, 3: 80}

  def submit(g, i):
    return g, orch.submit([10 + g, 2, 3], SamplingParams(seed=10 * g + i,
                                                         max_new_tokens=lengths[g]))

  try:
    first = [submit(g, i) for g in range(4) for i in range(2)]  # probes + one sibling each
    for _, r in first:
      assert r.wait(120) and r.finish_reason == "length"
    with orch._cv:  # all 12 queued before the loop admits any (4 slots)
      later = [submit(g, i) for g in range(4) for i in range(2, 5)]
    for _, r in later:
      assert r.wait(120) and r.finish_reason == "length"
  finally:
    orch.stop()
  by_group = {g: sorted((r for h, r in first if h == g), key=lambda r: r.first_token_at)
              for g in range(4)}
  for g, (probe, sibling) in by_group.items():  # the sibling waited for its probe
    assert sibling.first_token_at >= probe.finished_at
  order = [g for _, g in sorted((r.first_token_at, g) for g, r in later)]
  assert order[:3] == [3, 3, 3] and order[-3:] == [0, 0, 0], order


def test_group_speculative_decoding_is_exact(random_params):
  """Drafts from sibling samples: greedy samples come out exactly as without speculation
  (with most drafts accepted), and sampled tokens carry their exact log-probs."""
  from tests.rollout_server.test_engine import teacher_forced

  prompt = [9, 8, 7, 6]
  runs = {}
  for spec in (0, 4):
    engine = make_engine()
    orch = Orchestrator(engine, engine.load_params(random_params), speculative=spec).start()
    try:
      # The first sample runs alone; its siblings then draft from its finished output.
      greedy = [orch.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=40),
                              timeout=120)]
      greedy += [orch.submit(prompt, SamplingParams(temperature=0.0, max_new_tokens=40, seed=i))
                 for i in range(1, 4)]
      for r in greedy:
        assert r.wait(120) and r.finish_reason == "length"
      sampled = [orch.submit(prompt, SamplingParams(temperature=1.0, max_new_tokens=30, seed=i))
                 for i in range(4)]
      for r in sampled:
        assert r.wait(120)
      runs[spec] = (greedy, sampled, orch.stats())
    finally:
      orch.stop()
  (g0, _, s0), (g4, sampled, s4) = runs[0], runs[4]
  assert [r.output_ids for r in g4] == [r.output_ids for r in g0]
  # Each sibling accepts every draft: 4 of every 5 tokens after its first.
  assert s4["speculative"]["accepted"] >= 3 * 30 and s4["steps"] < s0["steps"]
  for r in sampled:  # every emitted token's log-prob is the policy's, draft or not
    want = teacher_forced(random_params, prompt + r.output_ids)[len(prompt):]
    np.testing.assert_allclose(r.output_logprobs, want, atol=2e-5)


def test_multi_step_decode_gives_the_same_tokens(random_params):
  """Decode steps run several to a device call (`decode_steps`): every request's tokens,
  log-probs, versions and finish reasons are those of one step a call, stop tokens and
  length budgets included (more requests than slots, so slots are reused)."""
  probe = None
  runs = {}
  for steps in (1, 5):
    engine = make_engine()
    orch = Orchestrator(engine, engine.load_params(random_params, version=3),
                        decode_steps=steps).start()
    try:
      if probe is None:
        probe = orch.generate([4, 5], SamplingParams(seed=1, max_new_tokens=12), timeout=60)
      stop = probe.output_ids[6]
      reqs = [orch.submit([4 + i % 2, 5], SamplingParams(
          seed=1 + i % 3, max_new_tokens=3 + 4 * i, stop_token_ids=(stop,) if i % 2 else ()))
          for i in range(10)]
      assert all(r.wait(120) for r in reqs)
      runs[steps] = ([(r.output_ids, r.output_logprobs, r.versions, r.finish_reason)
                      for r in reqs], orch.stats())
    finally:
      orch.stop()
  (one, s1), (many, s5) = runs[1], runs[5]
  assert many == one
  assert any(reason == "stop" for *_, reason in one)
  assert all(set(v) == {3} for _, _, v, _ in one)
  assert s5["live_slots"] == 0 and s5["queue"] == 0
  assert s5["kv_pages"]["used"] == s1["kv_pages"]["used"]


def test_a_request_queued_during_a_drain_runs_on_the_new_weights(random_params):
  """While a drain update waits for the running request, newly queued requests are not
  admitted: they run on the new weights (the running one finishes on the old)."""
  engine = make_engine()
  orch = Orchestrator(engine, engine.load_params(random_params, version=1)).start()
  gate = threading.Event()
  try:
    with orch._cv:  # (the loop admits nothing before the listener is on)
      running = orch.submit([4, 4, 4], SamplingParams(seed=0, max_new_tokens=6))
      running.add_listener(lambda req, n: n == 1 and gate.wait(60))
    _until(lambda: running.output_ids)  # the engine thread now waits in the listener
    new = engine.load_params({k: v * 1.5 for k, v in random_params.items()}, version=2)
    updater = threading.Thread(target=orch.update_weights, args=(new,), daemon=True)
    updater.start()
    _until(lambda: orch._update is not None)
    queued = orch.submit([4, 4, 4], SamplingParams(seed=0, max_new_tokens=6))
    gate.set()
    updater.join(60)
    assert queued.wait(60) and running.done
    assert set(running.versions) == {1} and set(queued.versions) == {2}
    assert orch.stats()["version"] == 2
  finally:
    gate.set()
    orch.stop()


def test_a_weight_update_that_times_out_is_withdrawn_not_swapped_later(random_params):
  """A drain update whose running request outlasts the caller's timeout is withdrawn:
  its caller was told it failed, and the engine goes on serving the old version (it
  swapped later, behind the caller's back) and admitting requests; a later update is
  taken."""
  engine = make_engine()
  orch = Orchestrator(engine, engine.load_params(random_params, version=1)).start()
  gate = threading.Event()
  try:
    with orch._cv:
      running = orch.submit([4, 4, 4], SamplingParams(seed=0, max_new_tokens=6))
      running.add_listener(lambda req, n: n == 1 and gate.wait(60))
    _until(lambda: running.output_ids)  # the engine thread now waits in the listener
    new = engine.load_params({k: v * 1.5 for k, v in random_params.items()}, version=2)
    with pytest.raises(TimeoutError, match="withdrawn, the engine still serves version 1"):
      orch.update_weights(new, timeout=0.3)
    gate.set()
    assert running.wait(60) and set(running.versions) == {1}
    after = orch.generate([4, 4, 4], SamplingParams(seed=0, max_new_tokens=3), timeout=60)
    assert set(after.versions) == {1} and orch.stats()["version"] == 1
    assert orch.update_weights(new, timeout=60)["version"] == 2
    assert orch.stats()["version"] == 2
  finally:
    gate.set()
    orch.stop()


def test_a_weight_update_swapped_in_is_told_done_whatever_fails_after(random_params):
  """A reviewer: the swap let the update go (under the lock, for a caller's withdrawal)
  before the prefix cache was cleared and the caller told; an error there (the loop goes
  on after one) left the caller waiting for ever, and every later update behind it."""
  engine = make_engine()
  orch = Orchestrator(engine, engine.load_params(random_params, version=1),
                      prefix_cache_tokens=128).start()
  try:
    def broken():
      raise RuntimeError("a refcount gone wrong")

    orch.prefix_cache.clear = broken
    new = engine.load_params({k: v * 1.5 for k, v in random_params.items()}, version=2)
    orch.update_weights(new, timeout=30)
    assert orch.version == 2
  finally:
    orch.stop()


def test_a_slot_let_go_samples_nothing_filtered_for_its_next_request(orch):
  """A reviewer: an empty slot kept its last request's top-p and top-k, and every later
  step of every row paid the vocabulary's sort until the slot was taken again."""
  done = orch.generate([4, 4, 4], SamplingParams(seed=0, max_new_tokens=2, top_p=0.5,
                                                 top_k=3), timeout=60)
  assert done.finish_reason == "length"
  _until(lambda: not any(orch._slots))
  with orch._cv:
    state = orch._state
    assert np.all(np.asarray(state.top_p) == 1.0) and np.all(np.asarray(state.top_k) == 0)


def test_request_ids_are_unique_while_in_flight_and_free_after(random_params):
  """A request id names one request in flight (a second is refused); once it finished
  it is free again: not aborted, no progress, and the id can be used anew."""
  engine = make_engine()
  orch = Orchestrator(engine, engine.load_params(random_params)).start()
  try:
    with orch._cv:
      first = orch.submit([1, 2], SamplingParams(max_new_tokens=2), request_id="a")
      with pytest.raises(ValueError, match="already in flight"):
        orch.submit([1, 2], request_id="a")
    assert first.wait(60) and first.finish_reason == "length"
    assert not orch.abort("a") and orch.progress("a") is None  # finished: not in flight
    again = orch.generate([1, 2], SamplingParams(max_new_tokens=2), request_id="a", timeout=60)
    assert again.finish_reason == "length" and again.output_ids == first.output_ids
  finally:
    orch.stop()


def test_stopping_aborts_queued_requests_and_refuses_new_ones(random_params):
  """`stop()` ends the requests still queued (aborted, no tokens: their callers waited
  for ever) and refuses any submitted after it."""
  engine = make_engine()
  orch = Orchestrator(engine, engine.load_params(random_params))  # not started
  queued = orch.submit([1, 2, 3])
  orch.stop()
  assert queued.done and queued.finish_reason == "abort" and queued.output_ids == []
  with pytest.raises(RuntimeError, match="stopped"):
    orch.submit([1, 2, 3])


def test_a_second_weight_update_is_refused_while_one_is_pending(random_params):
  """One weight update at a time: a second while the first waits is refused (it replaced
  the first, whose caller then waited for ever), and the first is done once the loop
  runs."""
  engine = make_engine()
  orch = Orchestrator(engine, engine.load_params(random_params, version=1))  # not started
  first = threading.Thread(target=orch.update_weights,
                           args=(engine.load_params(random_params, version=2),), daemon=True)
  first.start()
  _until(lambda: orch._update is not None)
  with pytest.raises(RuntimeError, match="already in progress"):
    orch.update_weights(engine.load_params(random_params, version=3))
  orch.start()
  try:
    first.join(60)
    assert not first.is_alive() and orch.stats()["version"] == 2
  finally:
    orch.stop()


def test_a_request_aborted_while_queued_never_takes_a_slot(random_params):
  """A request aborted before it was admitted ends as aborted without a slot or a page:
  none are left in use once the others are done."""
  engine = make_engine()
  orch = Orchestrator(engine, engine.load_params(random_params))
  kept = orch.submit([1, 2, 3], SamplingParams(seed=1, max_new_tokens=8))
  gone = orch.submit([5, 6, 7], SamplingParams(seed=2, max_new_tokens=8))
  assert orch.abort(gone.request_id)
  orch.start()  # (the abort is processed before anything is admitted)
  try:
    assert gone.wait(60) and gone.finish_reason == "abort" and gone.output_ids == []
    assert kept.wait(60) and kept.finish_reason == "length"
    s = orch.stats()
    assert s["live_slots"] == 0 and s["kv_pages"]["used"] == 0 and s["queue"] == 0
  finally:
    orch.stop()


def test_a_stop_token_at_the_last_allowed_position_ends_as_stop(orch):
  """A stop token sampled as the request's last allowed token ends it as `stop`, not
  `length` (the stop check came after the length check)."""
  probe = orch.generate([1, 2], SamplingParams(seed=3, max_new_tokens=10), timeout=60)
  stop = probe.output_ids[4]
  k = probe.output_ids.index(stop) + 1
  r = orch.generate([1, 2], SamplingParams(seed=3, max_new_tokens=k, stop_token_ids=(stop,)),
                    timeout=60)
  assert r.output_ids == probe.output_ids[:k] and r.finish_reason == "stop"


def test_a_prefill_call_with_a_chunked_prompt_gives_each_request_its_own_token(random_params):
  """A long prompt's chunk and a short prompt share a prefill call (the same bucket); the
  short one finishes its prefill there and gets its own first token, not the row of the
  still unfinished long one."""
  engine = make_engine(page_size=8)
  params = engine.load_params(random_params)
  long_prompt, short = list(range(1, 41)), [7, 8, 9]
  sampling = SamplingParams(seed=3, max_new_tokens=4)
  alone = Orchestrator(engine, params).start()
  try:
    want = [alone.generate(p, sampling, timeout=60).output_ids for p in (long_prompt, short)]
  finally:
    alone.stop()
  orch = Orchestrator(engine, params, prefill_chunk=16)
  real, sizes = engine.prefill_many, []

  def counted(**kw):
    sizes.append(len(kw["requests"]))
    return real(**kw)

  engine.prefill_many = counted  # (this engine's alone: made for this test)
  reqs = [orch.submit(p, sampling) for p in (long_prompt, short)]
  orch.start()
  try:
    assert all(r.wait(60) for r in reqs)
  finally:
    orch.stop()
  assert 2 in sizes, sizes  # (the two shared a call)
  assert [r.output_ids for r in reqs] == want


def test_a_loop_error_fails_the_live_requests_and_the_loop_goes_on(random_params):
  """An error of the engine's step fails the requests then live (with its message) and
  frees their slots and pages; the loop serves the next request (it died with them)."""
  engine = make_engine()
  orch = Orchestrator(engine, engine.load_params(random_params))
  real, calls = engine.generate, []

  def flaky(params, state):
    calls.append(1)
    if len(calls) == 2:
      raise RuntimeError("device lost")
    return real(params, state)

  engine.generate = flaky
  orch.start()
  try:
    hit = orch.generate([1, 2, 3], SamplingParams(max_new_tokens=8), timeout=60)
    assert hit.finish_reason == "error" and "device lost" in hit.error
    ok = orch.generate([1, 2, 3], SamplingParams(max_new_tokens=8), timeout=60)
    assert ok.finish_reason == "length" and len(ok.output_ids) == 8
    s = orch.stats()
    assert s["loop_errors"] == 1 and s["live_slots"] == 0 and s["kv_pages"]["used"] == 0
  finally:
    orch.stop()


def test_a_loop_that_cannot_recover_fails_every_request_at_once(random_params):
  """A reviewer: an error whose recovery failed too (a fresh KV pool that did not fit
  beside the old one) ended the engine's thread; every request, and every update, then
  waited for ever while /health said ok. Every request fails now, and every later one
  at once (`EngineDead`, a 503)."""
  from rollout_server.orchestrator import EngineDead

  engine = make_engine()
  orch = Orchestrator(engine, engine.load_params(random_params))
  real_generate, real_init = engine.generate, engine.init_decode_state

  def lost(params, state):
    raise RuntimeError("device lost")

  def out_of_memory():  # (the orchestrator made its own pool already)
    raise MemoryError("RESOURCE_EXHAUSTED: a second KV pool")

  engine.init_decode_state = out_of_memory
  engine.generate = lost
  orch.start()
  try:
    hit = orch.generate([1, 2, 3], SamplingParams(max_new_tokens=8), timeout=30)
    assert hit.finish_reason == "error" and "device lost" in hit.error
    deadline = time.time() + 10  # (its recovery fails just after it failed the request)
    while not orch.stats()["dead"] and time.time() < deadline:
      time.sleep(0.01)
    assert orch.stats()["dead"] and "a second KV pool" in orch.stats()["dead"]
    with pytest.raises(EngineDead, match="the engine loop died"):
      orch.submit([1, 2, 3], SamplingParams(max_new_tokens=8))
    with pytest.raises(EngineDead):
      orch.update_weights(engine.load_params(random_params, version=1), timeout=5)
  finally:
    engine.generate, engine.init_decode_state = real_generate, real_init
    orch.stop()


def test_a_stop_ends_a_waiting_update_and_a_loop_ended_by_any_error_dies_loudly(
    random_params):
  """A reviewer: `stop()` left an update waiting out its whole timeout, then told it the
  update was withdrawn with the engine still serving; and an error that is no
  Exception ended the loop's thread without a word, its requests waiting for ever while
  /health said ok. The update fails at once, and such a loop dies as any other."""
  from rollout_server.orchestrator import EngineDead

  engine = make_engine()
  orch = Orchestrator(engine, engine.load_params(random_params, version=1))  # not started
  failed = []

  def update():
    try:
      orch.update_weights(engine.load_params(random_params, version=2), timeout=120)
    except Exception as e:
      failed.append(e)

  waiting = threading.Thread(target=update, daemon=True)
  waiting.start()
  _until(lambda: orch._update is not None)
  t0 = time.time()
  orch.stop()
  waiting.join(10)
  assert not waiting.is_alive() and time.time() - t0 < 10
  assert failed and "stopped before the update was applied" in str(failed[0])

  engine = make_engine()
  orch = Orchestrator(engine, engine.load_params(random_params))
  real_generate = engine.generate

  def interrupted(params, state):
    raise KeyboardInterrupt("from a native callback")

  engine.generate = interrupted
  orch.start()
  try:
    hit = orch.generate([1, 2, 3], SamplingParams(max_new_tokens=8), timeout=30)
    assert hit.finish_reason == "error" and "KeyboardInterrupt" in hit.error
    assert orch.stats()["dead"]
    with pytest.raises(EngineDead, match="the engine loop died"):
      orch.submit([1, 2, 3], SamplingParams(max_new_tokens=8))
  finally:
    engine.generate = real_generate
    orch.stop()


def test_a_listener_that_raises_is_its_own_error_not_the_loops(random_params):
  """A reviewer: a request's listener that raised (a callback onto a closed event loop)
  was the loop's error: it failed every live request and reset the engine."""
  engine = make_engine()
  orch = Orchestrator(engine, engine.load_params(random_params)).start()
  try:
    bad = orch.submit([1, 2, 3], SamplingParams(seed=1, max_new_tokens=6))

    def boom(req, n):
      raise RuntimeError("loop is closed")

    bad.add_listener(boom)
    good = orch.generate([4, 5, 6], SamplingParams(seed=2, max_new_tokens=12), timeout=60)
    assert bad.wait(60) and bad.finish_reason == "length"
    assert good.finish_reason == "length" and orch.stats()["loop_errors"] == 0
  finally:
    orch.stop()


def test_settings_the_loop_cannot_run_are_refused_at_the_start(random_params):
  """A reviewer: a top_k past int32 from the Python API failed its whole prefill batch,
  and a negative prefill_chunk made every step of the loop an error."""
  engine = make_engine()
  with pytest.raises(ValueError, match="prefill_chunk must be >= 0"):
    Orchestrator(engine, engine.load_params(random_params), prefill_chunk=-4)
  orch = Orchestrator(engine, engine.load_params(random_params))
  with pytest.raises(ValueError, match="top_k must be in"):
    orch.submit([1, 2, 3], SamplingParams(top_k=1 << 40))


def test_a_failed_prefill_fails_its_request_alone(random_params):
  """A prefill call that raises ends its own requests with `error`; a request already
  decoding (prefilled in an earlier call: another bucket) runs to its end."""
  engine = make_engine()
  orch = Orchestrator(engine, engine.load_params(random_params))
  real = engine.prefill_many

  def refuse_99(**kw):
    if any(99 in list(r.tokens) for r in kw["requests"]):
      raise ValueError("bad row")
    return real(**kw)

  engine.prefill_many = refuse_99
  running = orch.submit(list(range(1, 21)), SamplingParams(seed=1, max_new_tokens=30))
  bad = orch.submit([99, 1, 2], SamplingParams(seed=2, max_new_tokens=30))
  orch.start()
  try:
    assert bad.wait(60) and bad.finish_reason == "error" and "bad row" in bad.error
    assert running.wait(60) and running.finish_reason == "length"
    assert len(running.output_ids) == 30 and orch.stats()["loop_errors"] == 0
  finally:
    orch.stop()


def _until(condition, timeout_s: float = 60.0) -> None:
  """Waits for `condition()` (a regression fails here, not by hanging the suite)."""
  deadline = time.monotonic() + timeout_s
  while not condition():
    assert time.monotonic() < deadline, "gave up waiting"
    time.sleep(0.001)


def _first_token_order(reqs, names):
  """Records, by name, the order in which `reqs` get their first token (listeners run on
  the engine thread in emission order; add them before the loop starts)."""
  order = []
  for r, name in zip(reqs, names):
    r.add_listener(lambda req, n, name=name: n == 1 and order.append(name))
  return order


def test_a_request_short_of_pages_keeps_its_place_at_the_head_of_the_queue(random_params):
  """Admission is in order: a request whose pages are not free waits at the head of the
  queue, and a smaller one behind it that would fit waits too (no overtaking, so a big
  request is never starved); once pages return, the big one is admitted first."""
  engine = make_engine(page_size=8, num_pages=1 + 10)
  orch = Orchestrator(engine, engine.load_params(random_params))  # not started
  running = orch.submit([1, 2, 3], SamplingParams(seed=1, max_new_tokens=30))  # 5 pages
  big = orch.submit([4, 5, 6], SamplingParams(seed=2, max_new_tokens=60))  # 8: not free yet
  small = orch.submit([7, 8, 9], SamplingParams(seed=3, max_new_tokens=5))  # 1: would fit
  order = _first_token_order([running, big, small], ["running", "big", "small"])
  orch.start()
  try:
    assert all(r.wait(60) for r in (running, big, small))
  finally:
    orch.stop()
  assert order == ["running", "big", "small"]
  assert small.first_token_at >= running.finished_at
  assert [r.finish_reason for r in (running, big, small)] == ["length"] * 3


def test_siblings_waiting_for_a_prompt_being_prefilled_keep_their_order_ahead_of_later_requests(
    random_params):
  """Samples of a prompt whose pages are being computed wait for it (to share them), but
  keep their places: once slots free they are admitted in submission order and before the
  requests queued after them."""
  engine = make_engine(max_concurrent_decodes=2, page_size=8)
  orch = Orchestrator(engine, engine.load_params(random_params), prefix_cache_tokens=256)
  prompt = list(range(1, 21))  # more than a page: its siblings wait for its prefill
  p1 = orch.submit(prompt, SamplingParams(seed=1, max_new_tokens=6))
  p2 = orch.submit(prompt, SamplingParams(seed=2, max_new_tokens=6))
  p3 = orch.submit(prompt, SamplingParams(seed=3, max_new_tokens=6))
  x = orch.submit([30, 31, 32], SamplingParams(seed=4, max_new_tokens=12))
  y = orch.submit([40, 41, 42], SamplingParams(seed=5, max_new_tokens=6))
  reqs, names = [p1, p2, p3, x, y], ["p1", "p2", "p3", "x", "y"]
  order = _first_token_order(reqs, names)
  orch.start()
  try:
    assert all(r.wait(60) for r in reqs)
  finally:
    orch.stop()
  assert sorted(order[:2]) == ["p1", "x"] and order[2:] == ["p2", "p3", "y"], order
  assert p2.prefix_hit_tokens > 0 and p3.prefix_hit_tokens > 0  # (they shared p1's pages)


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_a_request_takes_one_decode_step_a_token_after_the_one_its_prefill_samples(
    random_params, decode_steps):
  """No step is spent past a request's budget: alone, a request of n tokens takes n - 1
  decode steps (its first token comes from the prefill; one that wants a single token takes
  none), and one that runs to the cache's end takes one a position left."""
  engine = make_engine(max_seq_len=64, max_prefill_length=64, page_size=8)
  orch = Orchestrator(engine, engine.load_params(random_params),
                      decode_steps=decode_steps).start()
  try:
    for prompt, max_new, want in (([1, 2, 3], 1, 1), ([1, 2, 3], 9, 9),
                                  (list(range(1, 51)), 40, 64 - 50)):
      before = orch.stats()["steps"]
      r = orch.generate(prompt, SamplingParams(seed=1, max_new_tokens=max_new), timeout=60)
      assert r.finish_reason == "length" and len(r.output_ids) == want
      assert orch.stats()["steps"] - before == want - 1, (prompt[-1], max_new)
  finally:
    orch.stop()


def test_raw_log_probs_are_the_models_and_output_log_probs_the_sampling_distributions(
    random_params):
  """At a temperature other than 1 (with top-k) the two differ: `raw_logprobs` are the
  plain model's (as scoring gives them), `output_logprobs` the tempered, filtered
  distribution's the token was drawn from."""
  engine = make_engine(max_seq_len=64, max_prefill_length=64, page_size=8)
  params = engine.load_params(random_params)
  orch = Orchestrator(engine, params).start()
  try:
    r = orch.generate([3, 1, 4, 1, 5], SamplingParams(seed=7, max_new_tokens=12,
                                                      temperature=0.5, top_k=5), timeout=60)
  finally:
    orch.stop()
  fresh = engine.score(params, [r.prompt_ids + r.output_ids])[0][len(r.prompt_ids):]
  np.testing.assert_allclose(r.raw_logprobs, fresh, atol=1e-4)
  assert len(r.output_logprobs) == 12 and all(lp <= 0 for lp in r.output_logprobs)
  assert np.abs(np.subtract(r.output_logprobs, r.raw_logprobs)).max() > 1e-2


def test_a_finished_sequence_caches_only_positions_whose_kv_was_computed(random_params):
  """A request that ends by length never feeds its last token back, so that position has
  no KV: when the sequence ends on a page boundary, its last page is not cached, and the
  next turn recomputes it (exact log-probs) instead of reusing a page with a hole."""
  engine = make_engine(max_seq_len=64, max_prefill_length=64, page_size=8)
  params = engine.load_params(random_params)
  orch = Orchestrator(engine, params, prefix_cache_tokens=256).start()
  try:
    first = orch.generate([2, 7, 1, 8, 2], SamplingParams(seed=1, max_new_tokens=11),
                          timeout=60)  # 16 tokens: two whole pages
    assert first.finish_reason == "length"
    seq = first.prompt_ids + first.output_ids + [9, 9]
    nxt = orch.generate(seq, SamplingParams(seed=2, max_new_tokens=6), timeout=60)
  finally:
    orch.stop()
  assert nxt.prefix_hit_tokens == 8  # the first page; the second holds the unfed token
  fresh = engine.score(params, [seq + nxt.output_ids])[0][len(seq):]
  np.testing.assert_allclose(nxt.raw_logprobs, fresh, atol=1e-4)


def test_progress_calls_an_admitted_request_running_before_its_prompt_is_in_the_pool(
    random_params):
  """Taking a slot is what makes a request `running`: while its first prefill call runs
  (nothing of its prompt in the pool yet) progress and session_progress no longer count it
  as queued; a request still waiting for a slot is."""
  engine = make_engine(max_concurrent_decodes=1)
  orch = Orchestrator(engine, engine.load_params(random_params))
  real, seen = engine.prefill_many, []

  def looking(**kw):
    if not seen:
      seen.append((orch.progress("a"), orch.progress("b"), orch.session_progress("s")))
    return real(**kw)

  engine.prefill_many = looking
  a = orch.submit([1, 2, 3], SamplingParams(max_new_tokens=2), request_id="a", session_id="s")
  b = orch.submit([4, 5, 6], SamplingParams(max_new_tokens=2), request_id="b", session_id="s")
  orch.start()
  try:
    assert a.wait(60) and b.wait(60)
  finally:
    orch.stop()
  (pa, pb, sess), = seen
  assert pa["state"] == "running" and pa["prefilled"] == 0 and pa["output_tokens"] == 0
  assert pb["state"] == "queued"
  assert sess["requests"] == 2 and sess["queued"] == 1


def test_a_sampled_request_never_drafts_from_a_sibling_of_its_own_seed(random_params):
  """A sibling of the same seed drew its tokens from the random numbers that would
  verify them as drafts: not independent, the emitted tokens stopped following the
  policy while their log-probs said they did (an episode's retry keeps its first try's
  seed; a reviewer measured 0.93 for a token of p 0.55). A retry after its first try
  alone drafts nothing and samples the first try's tokens again; a request of another
  seed, or a greedy one, drafts from it."""
  prompt = [9, 8, 7, 6]
  engine = make_engine()
  orch = Orchestrator(engine, engine.load_params(random_params), speculative=4).start()
  hot = lambda seed: SamplingParams(temperature=0.05, max_new_tokens=24, seed=seed)
  try:
    first = orch.generate(prompt, hot(1), timeout=120)
    retry = orch.generate(prompt, hot(1 + (1 << 64)), timeout=120)  # (the same key)
    s = orch.stats()["speculative"]
  finally:
    orch.stop()
  assert s["proposed"] == 0 and retry.output_ids == first.output_ids
  out = first.output_ids
  for sampling, want in ((hot(1), []), (hot(2), out[3:7]),
                         (SamplingParams(temperature=0.0, seed=1), out[3:7])):
    assert orch._draft(Request(prompt, sampling, "r", output_ids=out[:3]), 4) == want


def test_speculative_decoding_ends_at_a_stop_token_inside_an_accepted_draft(random_params):
  """A stop token among a step's accepted draft tokens ends the request there: the draft
  tokens after it are discarded, as one token a step would have stopped."""
  K = 2
  engine = make_engine()
  orch = Orchestrator(engine, engine.load_params(random_params), speculative=K).start()
  greedy = SamplingParams(temperature=0.0, max_new_tokens=30)
  try:
    for prompt in ([100, 200, 5, 17], [9, 8, 7, 6], [1, 2, 3], [50, 60, 70]):
      out = orch.generate(prompt, greedy, timeout=60).output_ids
      # A token's first occurrence inside a verify window (a sibling accepts all K drafts:
      # tokens 1..K+1, K+2..2K+2, ...), not at its end.
      idx = next((i for i in range(2, 30) if out[i] not in out[:i] and i % (K + 1)), None)
      if idx is not None:
        break
    assert idx is not None, "no prompt's greedy output has a usable stop token"
    r = orch.generate(prompt, dataclasses.replace(greedy, stop_token_ids=(out[idx],)),
                      timeout=60)
    s = orch.stats()
  finally:
    orch.stop()
  assert r.finish_reason == "stop" and r.output_ids == out[:idx + 1], (idx, r.output_ids)
  assert len(r.output_logprobs) == len(r.versions) == idx + 1
  assert s["speculative"]["accepted"] > 0


def test_submit_takes_requests_up_to_each_limit_exactly(random_params):
  """Each of submit's limits at its edge: `resumed_tokens` below the prompt's length, the
  new part of a prompt up to max_prefill_length, the whole prompt short of max_seq_len,
  and prompt + max_new_tokens up to the pool's pages."""
  engine = make_engine(max_prefill_length=16, max_seq_len=32, page_size=8, num_pages=1 + 3)
  orch = Orchestrator(engine, engine.load_params(random_params))  # not started
  one = SamplingParams(max_new_tokens=1)
  try:
    orch.submit([1, 2, 3], one, resumed_tokens=2)
    for bad in (3, -1):
      with pytest.raises(ValueError, match="resumed_tokens"):
        orch.submit([1, 2, 3], one, resumed_tokens=bad)
    orch.submit([1] * 16, one)
    with pytest.raises(PromptTooLong, match="max_prefill_length"):
      orch.submit([1] * 17, one)
    orch.submit([1] * 20, one, resumed_tokens=4)
    with pytest.raises(PromptTooLong, match="max_prefill_length"):
      orch.submit([1] * 20, one, resumed_tokens=3)
    orch.submit([1] * 23, one, resumed_tokens=16)  # 24 tokens: the pool's 3 pages
    with pytest.raises(PromptTooLong, match="max_seq_len"):
      orch.submit([1] * 32, one, resumed_tokens=16)
    orch.submit([1] * 8, SamplingParams(max_new_tokens=16))  # 24 tokens: 3 pages
    with pytest.raises(PromptTooLong, match="KV pages"):
      orch.submit([1] * 8, SamplingParams(max_new_tokens=17))  # 25: 4 pages
    assert orch.stats()["queue"] == 5
  finally:
    orch.stop()


def test_a_page_aligned_prompt_in_the_cache_is_reused_all_but_its_last_token(random_params):
  """The last prompt token is always computed (its logits give the first sample): a prompt
  of two whole pages, cached, shares only its first page, and samples as it did uncached."""
  engine = make_engine(max_seq_len=64, max_prefill_length=64, page_size=8)
  orch = Orchestrator(engine, engine.load_params(random_params), prefix_cache_tokens=256).start()
  prompt, sampling = list(range(20, 36)), SamplingParams(seed=4, max_new_tokens=6)
  try:
    first = orch.generate(prompt, sampling, timeout=60)
    again = orch.generate(prompt, sampling, timeout=60)
  finally:
    orch.stop()
  assert first.prefix_hit_tokens == 0 and again.prefix_hit_tokens == 8
  assert again.finish_reason == "length" and again.output_ids == first.output_ids
  np.testing.assert_allclose(again.output_logprobs, first.output_logprobs, atol=1e-5)


def test_siblings_share_the_pages_of_a_prompt_prefilled_for_a_request_still_running(
    random_params):
  """A prompt's whole pages go into the prefix cache when its prefill ends, not when its
  request does: a sibling admitted while the first still decodes shares them (even with
  finished sequences not cached)."""
  engine = make_engine(page_size=8)
  orch = Orchestrator(engine, engine.load_params(random_params), prefix_cache_tokens=256,
                      cache_finished=False)
  prompt = list(range(1, 21))
  first = orch.submit(prompt, SamplingParams(seed=1, max_new_tokens=40))
  sibling = orch.submit(prompt, SamplingParams(seed=2, max_new_tokens=4))
  orch.start()
  try:
    assert sibling.wait(60) and sibling.finish_reason == "length"
    assert first.wait(60)
    assert sibling.first_token_at < first.finished_at  # (admitted while it still decoded)
    s = orch.stats()
  finally:
    orch.stop()
  assert first.prefix_hit_tokens == 0 and sibling.prefix_hit_tokens == 16
  assert s["shared_pages"] == 2


def test_a_request_short_of_pages_gives_back_the_cached_pages_it_matched(random_params):
  """A request that matches cached pages but finds too few free ones waits without holding
  them (it retries every loop turn): once all is done and the cache is dropped (a weight
  update), every page is free."""
  engine = make_engine(page_size=8, num_pages=1 + 8)
  orch = Orchestrator(engine, engine.load_params(random_params, version=1),
                      prefix_cache_tokens=64)
  prompt = list(range(1, 18))  # 17 tokens: its first two pages are cached at its prefill
  first = orch.submit(prompt, SamplingParams(seed=1, max_new_tokens=30))  # 6 of 8 pages
  second = orch.submit(prompt + [5], SamplingParams(seed=2, max_new_tokens=20))  # 5 pages
  orch.start()
  try:
    assert first.wait(60) and second.wait(60)
    assert second.prefix_hit_tokens == 16
    orch.update_weights(engine.load_params(random_params, version=2))
    s = orch.stats()
  finally:
    orch.stop()
  assert s["kv_pages"]["used"] == 0 and s["kv_pages"]["free"] == 8


def test_length_aware_admission_expects_the_longest_output_a_prompt_produced(random_params):
  """A prompt's expected length is the longest of its finished samples, not the last or
  the shortest: a prompt that once produced 40 tokens (and once 5) starts before one that
  produced 20 twice."""
  engine = make_engine(max_concurrent_decodes=1)
  orch = Orchestrator(engine, engine.load_params(random_params), length_aware=True).start()
  try:
    runs = [orch.submit([10, 2, 3], SamplingParams(seed=1, max_new_tokens=5)),
            orch.submit([10, 2, 3], SamplingParams(seed=2, max_new_tokens=40)),
            orch.submit([11, 2, 3], SamplingParams(seed=3, max_new_tokens=20)),
            orch.submit([11, 2, 3], SamplingParams(seed=4, max_new_tokens=20))]
    assert all(r.wait(60) for r in runs)
    with orch._cv:  # both queued before the loop admits either (one slot)
      twenty = orch.submit([11, 2, 3], SamplingParams(seed=5, max_new_tokens=3))
      forty = orch.submit([10, 2, 3], SamplingParams(seed=6, max_new_tokens=3))
    assert twenty.wait(60) and forty.wait(60)
  finally:
    orch.stop()
  assert forty.finished_at <= twenty.first_token_at


def test_a_request_whose_last_token_is_in_flight_takes_no_more_steps_while_others_wait(
    random_params):
  """While a request waits for pages (so steps go one at a time), a running request whose
  last token is already dispatched is not stepped again: the two take exactly their
  tokens less the ones their prefills sample."""
  engine = make_engine(page_size=8, num_pages=1 + 4)
  orch = Orchestrator(engine, engine.load_params(random_params))
  first = orch.submit([1, 2, 3], SamplingParams(seed=1, max_new_tokens=9))  # 2 pages
  waiting = orch.submit([4, 5, 6], SamplingParams(seed=2, max_new_tokens=20))  # 3: waits
  orch.start()
  try:
    assert first.wait(60) and waiting.wait(60)
    s = orch.stats()
  finally:
    orch.stop()
  assert waiting.first_token_at >= first.finished_at
  assert [len(r.output_ids) for r in (first, waiting)] == [9, 20]
  assert s["steps"] == (9 - 1) + (20 - 1)


def test_a_request_short_of_pages_evicts_cached_prefixes_nothing_runs_on(random_params):
  """Pages the prefix cache holds for finished sequences are not a reason to wait: a request
  that needs them evicts those no running sequence uses and is admitted at once."""
  engine = make_engine(page_size=8, num_pages=1 + 8)
  orch = Orchestrator(engine, engine.load_params(random_params), prefix_cache_tokens=64).start()
  try:
    done = orch.generate(list(range(1, 18)), SamplingParams(seed=1, max_new_tokens=30),
                         timeout=60)  # 47 tokens: its 5 whole pages stay cached
    assert done.finish_reason == "length" and orch.stats()["kv_pages"]["free"] == 3
    big = orch.generate([40, 41, 42], SamplingParams(seed=2, max_new_tokens=40),
                        timeout=20)  # 6 pages
    s = orch.stats()
  finally:
    orch.stop()
  assert big.finish_reason == "length" and len(big.output_ids) == 40
  assert s["prefix_cache"]["evicted_pages"] >= 3


def test_siblings_of_a_prompt_of_one_page_do_not_wait_for_its_prefill(random_params):
  """Only a prompt with more than a page to compute makes its siblings wait (they would
  share all but its last token, so at most a one-page prompt gives them nothing): with two
  slots, two samples of an 8-token prompt start together, ahead of a later request."""
  engine = make_engine(max_concurrent_decodes=2, page_size=8)
  orch = Orchestrator(engine, engine.load_params(random_params), prefix_cache_tokens=256)
  prompt = list(range(1, 9))
  reqs = [orch.submit(prompt, SamplingParams(seed=1, max_new_tokens=6)),
          orch.submit(prompt, SamplingParams(seed=2, max_new_tokens=6)),
          orch.submit([30, 31, 32], SamplingParams(seed=3, max_new_tokens=6))]
  order = _first_token_order(reqs, ["p1", "p2", "x"])
  orch.start()
  try:
    assert all(r.wait(60) for r in reqs)
  finally:
    orch.stop()
  assert order == ["p1", "p2", "x"]
  assert reqs[2].first_token_at >= min(reqs[0].finished_at, reqs[1].finished_at)


def test_the_samples_kept_for_drafts_and_lengths_are_bounded_by_their_tokens(monkeypatch):
  """The samples kept for their siblings' drafts were bounded by count alone (1,024
  prompts of 16 requests: of 32k-token prompts, 18 GB), and both records kept each prompt
  whole as their key (a reviewer): kept by a digest, within SIBLING_TOKENS."""
  import collections

  from rollout_server import orchestrator as orch_lib

  orch = Orchestrator.__new__(Orchestrator)  # (its records alone: no engine)
  orch._siblings, orch._sibling_tokens = collections.OrderedDict(), 0
  monkeypatch.setattr(orch_lib, "SIBLING_TOKENS", 1000)
  reqs = [Request([i] * 90, SamplingParams(max_new_tokens=10), f"r{i}") for i in range(50)]
  for req in reqs:
    orch._keep_sibling(req.prompt_key, req)
  assert len(orch._siblings) == 10 and orch._sibling_tokens == 1000
  assert list(orch._siblings) == [r.prompt_key for r in reqs[-10:]]
  assert all(len(k) == 16 for k in orch._siblings)
  same = [Request([7] * 9, SamplingParams(max_new_tokens=1), f"s{i}") for i in range(20)]
  for req in same:
    orch._keep_sibling(req.prompt_key, req)
  assert orch._siblings[same[0].prompt_key] == same[-16:]
  assert orch._sibling_tokens == sum(len(r.prompt_ids) + r.sampling.max_new_tokens
                                     for g in orch._siblings.values() for r in g)
