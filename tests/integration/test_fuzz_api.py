"""Fuzzing the HTTP API's payloads (submit, scale, cancel, job ids in paths) through the
ASGI app against a real etcd: every answer is 2xx or 4xx, never 5xx, and a 422 names
the field it refuses.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.http.api import create_app
from resilient_rl.cli import _validate_spec
from tests.conftest import EtcdServer

FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

leaf = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-2, 1100)
    | st.floats()
    | st.text(max_size=10)
    | st.sampled_from(["copy", "hf", "<script>alert(1)</script>", "../../x", "a/b", "x" * 80])
)
value = st.recursive(
    leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=6
)
job_name = st.sampled_from(["fz", "fz-2", "Fz", "../x", "a/b", "..", "", "x\x00", "x" * 64, "<b>"]) | st.text(
    max_size=12
)


@st.composite
def spec_payload(draw: st.DrawFn) -> Any:
    base: dict[str, Any] = {
        "name": draw(job_name),
        "model": {"init": {}},
        "task": {"kind": "copy", "num_prompts": 8},
        "rollout": {"replicas": 1, "engine": "hf"},
        "steps": 2,
    }
    for _ in range(draw(st.integers(0, 3))):
        section = draw(st.sampled_from(["model", "task", "rollout", "trainer", "checkpoint", "async", "fault"]))
        key = draw(
            st.sampled_from(["replicas", "kind", "dir", "init", "path", "lr", "every", "n"]) | st.text(max_size=4)
        )
        if draw(st.booleans()) or not isinstance(base.get(section), dict):
            base[section] = {} if draw(st.booleans()) else draw(value)
        if isinstance(base[section], dict):
            base[section][key] = draw(value)
    body = draw(st.sampled_from(["spec", "wrapped", "raw", "extra"]))
    if body == "spec":
        return {"spec": base}
    if body == "wrapped":
        return {"spec": draw(value)}
    if body == "extra":
        return {"spec": base, draw(st.text(max_size=5)): 1}
    return draw(value)


scale_payload = (
    st.dictionaries(
        st.sampled_from(["rollout", "trainer"]) | st.text(max_size=5), value | st.integers(-3, 2000), max_size=3
    )
    | value
)


@pytest.fixture
def client(etcd: EtcdServer) -> Iterator[TestClient]:
    app = create_app(etcd.store(retry_window=2.0), token=None, served_by="fuzz", validate_spec=_validate_spec)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def _ok(r: Any) -> None:
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code == 422:
        detail = r.json()["detail"]
        assert isinstance(detail, list) and detail, r.text
        for d in detail:
            assert d.get("loc") and d.get("msg"), r.text


def _post(client: TestClient, path: str, payload: Any) -> Any:
    return client.post(path, content=json.dumps(payload), headers={"Content-Type": "application/json"})


@FUZZ
@given(payload=spec_payload())
def test_submit_payloads_never_5xx(client: TestClient, payload: Any) -> None:
    r = _post(client, "/api/v1/jobs", payload)
    _ok(r)
    if r.status_code == 422 and isinstance(payload, dict) and isinstance(payload.get("spec"), dict):
        # spec errors say which field: body.spec.<field>
        for d in r.json()["detail"]:
            assert d["loc"][:1] == ["body"], r.text
    if r.status_code == 201:
        assert client.get(f"/api/v1/jobs/{r.json()['id']}").status_code == 200


@FUZZ
@given(job=job_name, payload=scale_payload)
def test_scale_and_cancel_payloads_never_5xx(client: TestClient, job: str, payload: Any) -> None:
    # a job that exists, so that valid payloads reach etcd too
    if client.get("/api/v1/jobs/fz").status_code == 404:
        spec = {"name": "fz", "model": {"init": {}}, "rollout": {"engine": "hf"}}
        assert _post(client, "/api/v1/jobs", {"spec": spec}).status_code == 201
    path_job = quote(job, safe="")
    _ok(_post(client, f"/api/v1/jobs/{path_job}/scale", payload))
    _ok(_post(client, "/api/v1/jobs/fz/scale", payload))
    _ok(client.post(f"/api/v1/jobs/{path_job}/cancel"))
    for tail in ("", "/view", "/events", "/members", "/checkpoints"):
        _ok(client.get(f"/api/v1/jobs/{path_job}{tail}"))
    _ok(client.get(f"/jobs/{path_job}"))


def test_hostile_job_ids_are_422_naming_the_job(client: TestClient) -> None:
    for bad in ["..", "Fz", "x" * 64, "-x", "x-", "a%2Fb", "..%2Fx", "x%00", "%3Cb%3E"]:
        for method, tail in [("GET", ""), ("GET", "/view"), ("POST", "/cancel")]:
            r = client.request(method, f"/api/v1/jobs/{bad}{tail}")
            assert r.status_code in (404, 422), (bad, tail, r.status_code, r.text)
            if r.status_code == 422:
                assert r.json()["detail"][0]["loc"] == ["path", "job"], r.text
        r = _post(client, "/api/v1/jobs", {"spec": {"name": bad.replace("%2F", "/").replace("%00", "\x00"),
                                                    "model": {"init": {}}}})  # fmt: skip
        assert r.status_code == 422 and any(d.get("field") == "name" for d in r.json()["detail"]), r.text


def test_every_mutation_needs_the_token(etcd: EtcdServer) -> None:
    """Each route that is not a read refuses a request without (or with a wrong) token: 401."""
    from fastapi.routing import APIRoute

    app = create_app(etcd.store(), token="the-token", served_by="t", validate_spec=_validate_spec)
    mutations = [
        (m, r.path)
        for r in app.routes
        if isinstance(r, APIRoute)
        for m in r.methods
        if m not in ("GET", "HEAD", "OPTIONS")
    ]
    assert len(mutations) >= 4, mutations  # submit, cancel, scale, kill
    with TestClient(app) as c:
        for method, path in mutations:
            url = path.replace("{job}", "j").replace("{group}", "rollout").replace("{worker}", "0")
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic dGhlLXRva2Vu"}):
                r = c.request(method, url, json={"spec": {}, "rollout": 1}, headers=headers)
                assert r.status_code == 401, (method, url, headers, r.status_code)
        r = c.post("/api/v1/jobs/j/cancel", headers={"Authorization": "Bearer the-token"})
        assert r.status_code == 404  # past the token check


def test_non_finite_numbers_are_422_not_500(client: TestClient) -> None:
    # Python's JSON parser takes Infinity/NaN; the 422 that names the field must still render
    for path, body in [
        ("/api/v1/jobs", '{"spec": Infinity}'),
        ("/api/v1/jobs", '{"spec": {"name": "fz", "steps": NaN}}'),
        ("/api/v1/jobs/fz/scale", '{"rollout": -Infinity}'),
    ]:
        r = client.post(path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 422, (path, body, r.status_code, r.text)
        _ok(r)
