"""HTML injection: the overview, the job page and the events render what etcd holds as text.

Job ids cannot carry HTML (they are DNS labels, see tests/unit/test_paths.py), so the
hostile strings go where free text lives: the failure reason, the phase, event
messages and kinds, worker records (node, status) and the spec's model path. The page
renders dynamic parts with ``textContent`` in app.js; here we check the server side:
nothing hostile reaches the HTML unescaped, and the JSON embedded in the page cannot
close its ``<script>`` element.
"""

from __future__ import annotations

import json
import re
import time

import pytest
from fastapi.testclient import TestClient

from controller import jobs, keys
from controller.http.api import STATIC, create_app
from resilient_rl.cli import _validate_spec
from tests.conftest import EtcdServer

EVIL = [
    "<script>alert('x')</script>",
    '"><img src=x onerror=alert(1)>',
    "</script><script>alert(2)</script>",
    "<!--",
    "' onmouseover='alert(3)",
]


@pytest.fixture
def client(etcd: EtcdServer) -> TestClient:
    store = etcd.store()
    app = create_app(store, token=None, served_by='<b>"srv"</b>', validate_spec=_validate_spec)
    _, spec_json, desired = _validate_spec(
        {"name": "esc", "model": {"path": EVIL[1]}, "rollout": {"engine": "hf"}, "steps": 4}
    )
    jobs.submit(store, "esc", spec_json, desired)
    bad = " | ".join(EVIL)
    store.put(keys.state("esc"), json.dumps({"phase": EVIL[1], "reason": bad, "step": 1, "reward": 0.5}))
    for seq, ev in enumerate(EVIL):
        body = {"seq": seq, "time": time.time(), "kind": ev, "message": ev, "leader": EVIL[0]}
        store.put(keys.event("esc", seq), json.dumps(body))
    member = {"node": EVIL[1], "pid": 1, "status": EVIL[0], "version": EVIL[2], "progress_at": time.time()}
    store.put(keys.member("esc", "rollout", "0"), json.dumps(member))
    return TestClient(app)


def _no_raw_html(page: str) -> None:
    # the embedded view is JSON in a script element: inert unless it holds a "<" ("</script", "<!--")
    m = re.search(r'(<script id="initial-view"[^>]*>)(.*?)(</script>)', page, re.S)
    html_part = page if m is None else page[: m.start(2)] + page[m.end(2) :]
    if m is not None:
        assert "<" not in m.group(2)
    for ev in EVIL:
        assert ev not in html_part, ev
    # the only script elements are the page's own: its app.js and the embedded initial view
    tags = re.findall(r"<script[^>]*>", page)
    assert all(t.startswith(('<script id="initial-view"', "<script src=")) for t in tags), tags
    assert "<img" not in page


def test_overview_escapes(client: TestClient) -> None:
    r = client.get("/")
    assert r.status_code == 200
    _no_raw_html(r.text)
    assert 'href="/jobs/esc"' in r.text
    assert "&quot;&gt;&lt;img src=x onerror=alert(1)&gt;" in r.text  # the phase, as text


def test_job_page_escapes_reason_events_workers(client: TestClient) -> None:
    r = client.get("/jobs/esc")
    assert r.status_code == 200
    page = r.text
    _no_raw_html(page)
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page  # the reason, as text
    m = re.search(r'<script id="initial-view"[^>]*>(.*?)</script>', page, re.S)
    assert m is not None, "the page embeds its initial view"
    view = json.loads(m.group(1))  # still valid JSON, and it holds the hostile strings intact as data
    assert {e["message"] for e in view["events"]} == set(EVIL)
    assert view["workers"]["rollout"][0]["node"] == EVIL[1]
    # the events API returns them as data, as JSON, not HTML
    r = client.get("/api/v1/jobs/esc/events")
    assert r.headers["content-type"].startswith("application/json")
    assert [e["message"] for e in r.json()["events"]] == EVIL


def test_app_js_renders_with_text_content_only() -> None:
    js = (STATIC / "app.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in js.replace("never innerHTML", ""), sink
