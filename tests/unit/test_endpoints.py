"""etcd endpoints as given to --etcd, RRL_ETCD or a controller: host:port, the port a real one."""

from __future__ import annotations

import pytest

from controller.store import parse_endpoints
from tests.conftest import run_rrl


def test_endpoints_are_split_and_their_scheme_dropped() -> None:
    assert parse_endpoints(" http://a:2379, https://b:1,[::1]:65535 ,") == ["a:2379", "b:1", "[::1]:65535"]


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("127.0.0.1:99999", "the port must be a number from 1 to 65535"),  # was dialled as port 34463
        ("127.0.0.1:0", "the port must be a number from 1 to 65535"),
        ("h:x", "the port must be a number from 1 to 65535"),
        ("h:", "the port must be a number from 1 to 65535"),
        (":2379", "must be host:port"),
        ("h", "must be host:port"),
        (",", "no etcd endpoint given"),
    ],
)
def test_a_bad_endpoint_is_refused_naming_it(given: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_endpoints(given)


def test_the_cli_exits_2_on_a_port_out_of_range() -> None:
    r = run_rrl("status", "--etcd", "127.0.0.1:99999")
    assert r.returncode == 2 and "--etcd: etcd endpoint '127.0.0.1:99999': the port must be" in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("notaurl", "must be an http:// or https:// URL with a host"),  # was an httpx traceback
        ("ftp://x", "must be an http:// or https:// URL with a host"),
        ("http://127.0.0.1:99999", "is not a URL (Port out of range"),
        ("http://h:0", "the port must be from 1 to 65535"),
    ],
)
def test_a_bad_api_url_exits_2_naming_it(given: str, says: str) -> None:
    r = run_rrl("cancel", "some-job", "--api", given)
    assert r.returncode == 2 and f"--api: {given!r}" in r.stderr and says in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
