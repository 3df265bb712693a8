"""Schema fuzzing of a real server: requests generated from its own /openapi.json
(schemathesis, on hypothesis), valid ones and ones that break the schema, never get a
5xx, and the server serves afterwards."""

import itertools

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.rollout_server.conftest import make_engine, running_server

EXAMPLES = 12  # per operation: a bounded budget for CI


def test_generated_requests_never_get_a_server_error(random_params, tokenizer):
  # A short cache keeps every generated request's decoding short.
  engine = make_engine(max_seq_len=96, max_prefill_length=64)
  with running_server(random_params, tokenizer, engine=engine) as (srv, orch):
    schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
    seen = {}
    for result, mode in itertools.product(list(schema.get_all_operations()), GenerationMode):
      op = result.ok()

      @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
      @given(case=op.as_strategy(mode))
      def check(case):
        response = case.call(base_url=srv.url, timeout=60)
        seen.setdefault(op.label, set()).add(response.status_code)
        assert response.status_code < 500, (case.method, case.path, case.body,
                                            response.status_code, response.text[:500])

      try:
        check()
      except Unsatisfiable:  # nothing in this operation can break its schema (no inputs)
        assert mode is GenerationMode.NEGATIVE
    assert {"POST /generate", "POST /v1/chat/completions", "POST /v1/messages",
            "POST /v1/responses", "GET /v1/models"} <= set(seen)
    # Some generated requests were valid, some refused by the schema's ranges.
    assert 200 in seen["POST /generate"] and 422 in seen["POST /generate"], seen
    assert 422 in seen["POST /v1/chat/completions"], seen
    assert 422 in seen["POST /v1/messages"], seen
    assert 422 in seen["POST /v1/responses"], seen
    assert httpx.get(srv.url + "/health", timeout=10).json()["status"] == "ok"
    assert orch.loop_errors == 0
