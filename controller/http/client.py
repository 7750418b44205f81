"""The CLI's client of the controller API.

``ApiClient.discover`` picks a controller from the HTTP addresses the
controllers register in etcd (``controllers/{id}``: ``http``), leader first,
and moves to the next one on a connection error. With none reachable it runs
the same app in-process against etcd (``create_app(store, token=None)``): the
caller can write to etcd anyway, and `rrl status` keeps working while every
controller is down. Either way a job operation takes one path: the API's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from .. import service
from ..store import Store


class ApiError(Exception):
    """A non-2xx answer: ``status`` and the server's ``detail``."""

    def __init__(self, status: int, detail: Any) -> None:
        self.status, self.detail = status, detail
        super().__init__(f"{status}: {self.message}")

    @property
    def message(self) -> str:
        if isinstance(self.detail, list):  # validation errors: "field: msg; ..."
            return "; ".join(
                f"{d.get('field') or '.'.join(str(p) for p in d.get('loc', [])[1:])}: {d.get('msg')}"
                for d in self.detail
            )
        return str(self.detail)


class Unreachable(Exception):
    """No controller answered."""


class ApiClient:
    """Calls ``/api/v1`` on one of ``urls``; when none answers, on ``app_factory()`` in-process."""

    def __init__(
        self, urls: list[str], token: str | None, *, app_factory: Callable[[], Any] | None = None, timeout: float = 10.0
    ) -> None:
        self.urls = list(urls)
        self.token = token
        self.timeout = timeout
        self.app_factory = app_factory
        self.url: str | None = None  # the one that answered last
        self._inproc: Any = None

    @classmethod
    def discover(cls, store: Store, token: str | None, app_factory: Callable[[], Any]) -> ApiClient:
        """Controllers registered in etcd (leader first); ``app_factory()`` builds the fallback app."""
        urls = [c["http"] for c in service.controllers(store) if c.get("http")]
        return cls(urls, token, app_factory=app_factory)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def request(self, method: str, path: str, **kw: Any) -> Any:
        """Send one request; returns the decoded JSON. Raises ApiError (non-2xx) or Unreachable."""
        resp = None
        for url in self.urls:
            try:
                resp = httpx.request(method, url + path, headers=self._headers(), timeout=self.timeout, **kw)
            except (httpx.ConnectError, httpx.ConnectTimeout):
                continue  # this controller is gone: try the next
            self.url = url
            break
        if resp is None:
            if self.app_factory is None:
                raise Unreachable(f"no controller answered at {', '.join(self.urls) or '(none registered)'}")
            if self._inproc is None:
                from fastapi.testclient import TestClient

                self._inproc = TestClient(self.app_factory())
            self.url = None
            resp = self._inproc.request(method, path, headers=self._headers(), **kw)
        if resp.status_code >= 400:
            try:
                detail = resp.json().get("detail", resp.text)
            except ValueError:
                detail = resp.text
            raise ApiError(resp.status_code, detail)
        return resp.json()

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params=params or None)

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, json=body)
