"""One HTTP client for the tests that talk to a running kvtier serve app (tests/serve,
tests/hosts, tests/bench): the OpenAI routes, the admin routes and /metrics. `complete` and
`chat` check for a 200 and return the JSON body; `post` and `get` return the response for a
test that checks the status itself."""
from __future__ import annotations

from typing import Any

import requests


class ServeClient:
    """Requests to the app at `base` (`http://host:port`) for `model`; `admin_key` is sent as
    the bearer token where a call says `admin=True`."""

    def __init__(self, base: str, model: str, admin_key: str = "",
                 timeout_s: float = 120) -> None:
        self.base, self.model, self.admin_key, self.timeout_s = base, model, admin_key, timeout_s

    def headers(self, admin: bool = False, key: str | None = None) -> dict[str, str]:
        """The Authorization header for the admin key (`admin`) or another bearer `key`."""
        token = self.admin_key if admin else key
        return {"Authorization": f"Bearer {token}"} if token else {}

    def post(self, path: str, body: Any, *, admin: bool = False, key: str | None = None,
             timeout_s: float | None = None, stream: bool = False) -> requests.Response:
        return requests.post(f"{self.base}{path}", json=body, stream=stream,
                             headers=self.headers(admin, key),
                             timeout=self.timeout_s if timeout_s is None else timeout_s)

    def get(self, path: str, *, admin: bool = False, timeout_s: float = 30) -> requests.Response:
        return requests.get(f"{self.base}{path}", headers=self.headers(admin), timeout=timeout_s)

    def answer(self, path: str, body: dict, key: str | None = None) -> dict:
        """POST `body` to `path`: the JSON body of its 200 (anything else fails the test)."""
        r = self.post(path, body, key=key)
        assert r.status_code == 200, r.text
        return r.json()

    def complete(self, prompt: str | list[int], max_tokens: int = 8, key: str | None = None,
                 **fields: Any) -> dict:
        """A greedy completion (temperature 0 unless `fields` say otherwise)."""
        return self.answer("/v1/completions", {"model": self.model, "prompt": prompt,
                                               "max_tokens": max_tokens, "temperature": 0,
                                               **fields}, key)

    def chat(self, messages: list[dict], max_tokens: int = 8, **fields: Any) -> dict:
        """A greedy chat completion (temperature 0 unless `fields` say otherwise)."""
        return self.answer("/v1/chat/completions", {"model": self.model, "messages": messages,
                                                    "max_tokens": max_tokens, "temperature": 0,
                                                    **fields})

    def router(self) -> dict:
        """/admin/router's `instances`: each instance's load, liveness and indexed pages."""
        r = self.get("/admin/router", admin=True)
        assert r.status_code == 200, r.text
        return r.json()["instances"]

    def flush(self) -> dict:
        r = self.post("/admin/flush", None, admin=True, timeout_s=60)
        assert r.status_code == 200, r.text
        return r.json()

    def metrics(self) -> str:
        """/metrics in Prometheus' text format."""
        return self.get("/metrics").text
