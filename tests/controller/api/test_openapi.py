"""The published OpenAPI document: frozen by a snapshot, and fuzzed with schemathesis (no 5xx for any
generated request, authenticated or not)."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.controller.api.helpers import job_yaml, yaml_headers
from tests.controller.conftest import ADMIN_TOKEN
from tests.controller.snapshot import assert_matches_snapshot

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def test_openapi_snapshot(app) -> None:
    doc = app.openapi()
    assert doc["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/TrainingJob"
    }
    assert_matches_snapshot(doc, "openapi.json")


def test_fuzzed_requests_never_get_a_server_error(client) -> None:
    # Hypothesis strategies per operation rather than `schemathesis.pytest.from_fixture`, whose lazy
    # parametrization does not run under the pytest version this project pins.
    r = client.post("/v1/jobs", content=job_yaml(), headers=yaml_headers(ADMIN))
    assert r.status_code == 201
    api = schemathesis.openapi.from_asgi("/openapi.json", client.app)
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 12
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=10, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
        def no_5xx(case) -> None:
            for headers in (ADMIN, {}):
                response = case.call(headers=headers)
                assert response.status_code < 500, (case.method, case.formatted_path, response.status_code,
                                                     response.text)

        no_5xx()
