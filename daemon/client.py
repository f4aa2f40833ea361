"""Talking to a running daemon: ``kvstrata status`` and ``kvstrata prefetch`` (standard library only).

With ``auth = "token"`` in the daemon's config, :func:`token_for` reads its bearer token (the
``token_file``, default ``<state_dir>/api-token``) and the calls here send it.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvstrata.config import KVStrataConfig

from .state import DaemonError, read_state, read_token, token_path

TIMEOUT_S = 5.0
BUSY_RETRIES = 2  # a 503 (hint queue or connections full) is retried this often, after its Retry-After
MAX_RETRY_WAIT_S = 2.0


def daemon_url(state_dir: Path) -> str:
    """The HTTP address a running daemon wrote into its state file."""
    state = read_state(state_dir)
    if not state or not state.get("url"):
        raise DaemonError(f"no daemon state in {state_dir} (is `kvstrata daemon` running with this config?)")
    if state.get("state") == "stopped":
        raise DaemonError(f"the daemon of {state_dir} has stopped (pid {state.get('pid')})")
    return str(state["url"])


def token_for(config: KVStrataConfig) -> str | None:
    """The bearer token to send to the daemon of ``config`` (None unless ``auth = "token"``)."""
    if config.daemon.auth != "token":
        return None
    return read_token(token_path(config))


def _request(url: str, data: bytes | None = None, token: str | None = None) -> Any:
    headers = {"Content-Type": "application/json"} if data else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    for attempt in range(BUSY_RETRIES + 1):
        req = urllib.request.Request(url, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 503 and attempt < BUSY_RETRIES and _retry_after(exc) is not None:
                time.sleep(min(MAX_RETRY_WAIT_S, _retry_after(exc) or 1.0))
                continue
            if exc.code == 401:
                hint = (
                    "the token sent was refused (is token_file the daemon's?)"
                    if token
                    else 'it runs with auth = "token": give the daemon\'s --config, so its token_file is read'
                )
                raise DaemonError(f"{url}: HTTP 401, the daemon wants its API token: {hint}") from None
            try:
                return json.loads(exc.read())
            except ValueError:
                raise DaemonError(f"{url}: HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise DaemonError(f"cannot reach the daemon at {url}: {getattr(exc, 'reason', exc)}") from None
    raise AssertionError("unreachable")  # pragma: no cover


def _retry_after(exc: urllib.error.HTTPError) -> float | None:
    try:
        return float(exc.headers.get("Retry-After", ""))
    except ValueError:
        return None


def fetch_status(url: str, token: str | None = None) -> dict[str, Any]:
    data = _request(url.rstrip("/") + "/status", token=token)
    if not isinstance(data, dict):
        raise DaemonError(f"{url}/status: unexpected answer")
    if "error" in data:
        raise DaemonError(f"{url}/status: {data['error']}")
    return data


def post_prefetch(url: str, namespace: str, keys: list[bytes], token: str | None = None) -> dict[str, Any]:
    body = json.dumps({"ns": namespace, "keys": [k.hex() for k in keys]}).encode()
    data = _request(url.rstrip("/") + "/prefetch", body, token)
    if not isinstance(data, dict) or "error" in data:
        raise DaemonError(f"{url}/prefetch: {data.get('error') if isinstance(data, dict) else data}")
    return data
