"""Run a real nodeserver (ServerApp) on loopback in a background thread with its own event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from server.app import ServerApp
from server.config import ServerConfig, config_from_mapping


def server_config(data_dir: Path, **overrides: Any) -> ServerConfig:
    doc: dict[str, Any] = {
        "trust_domain": "example.org",
        "data_dir": str(data_dir),
        "listen": "127.0.0.1:0",
        "metrics_listen": "127.0.0.1:0",
    }
    doc.update(overrides)
    return config_from_mapping(doc)


class ServerThread:
    """``ServerApp`` in a thread: ``start()`` returns once it listens; ``stop()`` shuts it down."""

    def __init__(self, config: ServerConfig, **app_kwargs: Any) -> None:
        self.config = config
        self.app = ServerApp(config, **app_kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="nodeserver-test", daemon=True)

    def start(self) -> ServerThread:
        self._thread.start()
        self.call(self.app.start)
        return self

    def call(self, coro_fn: Callable[[], Any], timeout: float = 60) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro_fn(), self._loop)
        return fut.result(timeout)

    def stop(self) -> None:
        if self._thread.is_alive():
            self.call(lambda: self.app.stop(grace=0.2))
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.app.ports.attest}"

    @property
    def bundle(self) -> bytes:
        assert self.app.ca is not None
        return self.app.ca.bundle_pem()

    def admit(self, spiffe_id: str, node_name: str = "node-1", pool: str = "cpu") -> None:
        """Record a granted join of ``spiffe_id`` in the store, as the join broker does when it grants one
        (server.join_service): for the tests of what needs an admitted machine (DevID enrolment) and not
        of the join itself, which tests/join covers."""
        import time

        from server.store.base import JoinRecord

        assert self.app.store is not None
        self.app.store.record_join(
            JoinRecord(agent_id=spiffe_id, node_name=node_name, pool=pool, token_id="test00", verdict="pass",
                       at=int(time.time()))
        )  # fmt: skip

    def audit_lines(self) -> list[dict[str, Any]]:
        import json

        path = self.config.audit_path
        return (
            [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if path.exists()
            else []
        )

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
