"""Who may call the server: vLLM's `api_key` (`vllm serve --api-key`), a bearer token on every `/v1` route.

The server binds 127.0.0.1 by default; bound to another address (`host=0.0.0.0`), anyone who reaches the
port could run the model. With a key set, every path under `/v1` (as vLLM guards: the prefix, whatever the
route or method) needs `Authorization: Bearer <key>` (the scheme in any case, as vLLM and OpenAI accept
it) and is otherwise answered 401 with OpenAI's error object, before its body is read. `/health` and
`/metrics` stay open, so probes and Prometheus need no secret (the metrics carry counts and latencies,
never a prompt or the key); an unknown path outside `/v1` is a 404 with or without a key.

Where the key comes from (`resolve_api_key`, at start): `api_key=...` in the serve config, else the file
`api_key_file=PATH` (its whole text, stripped), else the environment variable `NANO_VLLM_API_KEY`; both
config keys at once is an error. A key on the command line shows in `ps`, so on a shared machine prefer
the file or the environment (the serve config keeps Hydra from writing its overrides to disk).

The key is never logged, printed or put in an error message or a repr: the middleware keeps only its
SHA-256 digest. A presented token is hashed too and compared with `hmac.compare_digest`, so the time a
comparison takes says nothing about how much of the key a guess got right, nor about the key's length.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import warnings
from collections.abc import Mapping

from nano_vllm.serve.protocol import error_body

ENV_VAR = "NANO_VLLM_API_KEY"
GUARDED_PREFIX = "/v1"  # vLLM's: every path that starts with it

# OpenAI's messages (without its account links)
MISSING = ("You didn't provide an API key. You need to provide your API key in an Authorization header "
           "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
INCORRECT = "Incorrect API key provided."


def check_api_key(key: object, source: str) -> str:
    """`key` if it can be sent in an HTTP header as is (a non-empty string of printable ASCII without
    surrounding whitespace); else a TypeError or ValueError naming `source` — never the key."""
    if not isinstance(key, str):
        raise TypeError(f"{source} must be a string, got a {type(key).__name__} (on a Hydra command line "
                        "quote a key that reads as a number or a bool: api_key=\"'...'\")")
    if not key:
        raise ValueError(f"{source} is empty: give a key, or unset it to serve without one")
    if key != key.strip() or not (key.isascii() and key.isprintable()):
        raise ValueError(f"{source} must be printable ASCII without leading or trailing whitespace "
                         "(what an Authorization header can carry)")
    return key


def resolve_api_key(api_key: object = None, api_key_file: object = None,
                    environ: Mapping[str, str] | None = None) -> str | None:
    """The server's key: `api_key`, else the stripped text of the file `api_key_file`, else the
    environment variable NANO_VLLM_API_KEY; None if none is set (the server is open). Both `api_key`
    and `api_key_file` is a ValueError; an unreadable or empty file a ValueError naming its path."""
    environ = os.environ if environ is None else environ
    if api_key is not None and api_key_file is not None:
        raise ValueError("give the API key once: api_key or api_key_file, not both")
    if api_key is not None:
        return check_api_key(api_key, "api_key")
    if api_key_file is not None:
        if not isinstance(api_key_file, (str, os.PathLike)):
            raise TypeError(f"api_key_file must be a path, got {api_key_file!r}")
        path = os.fspath(api_key_file)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
            raise ValueError(f"api_key_file {path!r} cannot be read: {reason}") from None
        if not text:
            raise ValueError(f"api_key_file {path!r} is empty")
        return check_api_key(text, f"the key in api_key_file {path!r}")
    if ENV_VAR in environ:
        return check_api_key(environ[ENV_VAR], f"the environment variable {ENV_VAR}")
    return None


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (127.0.0.0/8, ::1, an IPv4-mapped 127.x) or "localhost"."""
    name = host.strip("[]").rstrip(".").lower()
    if name == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False  # another host name: it may resolve to any interface
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def warn_if_exposed(host: str, api_key: str | None) -> bool:
    """Warn (UserWarning) when the server binds a non-loopback `host` without an API key; True if it
    warned."""
    if api_key is not None or is_loopback(host):
        return False
    where = host or "every interface"
    warnings.warn(f"nano_vllm.serve: listening on {where} without an API key: anyone who can reach this "
                  f"port can use /v1. Set api_key_file=PATH, {ENV_VAR} or api_key=..., or bind "
                  "host=127.0.0.1", UserWarning, stacklevel=2)
    return True


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class APIKeyAuth:
    """ASGI middleware: a request to a path under `/v1` passes with `Authorization: Bearer <key>` and is
    answered 401 (OpenAI's error object) otherwise; every other path passes untouched."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._digest = _digest(check_api_key(api_key, "api_key").encode())  # never the key itself

    def __repr__(self) -> str:
        return f"{type(self).__name__}(guarding {GUARDED_PREFIX!r})"

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> tuple[bool, str, str | None]:
        """(passes, message, code) for a request's raw ASGI headers (the first Authorization header)."""
        value = next((v for k, v in headers if k.lower() == b"authorization"), b"")
        scheme, _, token = value.partition(b" ")
        token = token.lstrip(b" ")
        if scheme.lower() != b"bearer" or not token:
            return False, MISSING, None
        if not hmac.compare_digest(_digest(token), self._digest):
            return False, INCORRECT, "invalid_api_key"
        return True, "", None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GUARDED_PREFIX):
            return await self.app(scope, receive, send)
        ok, message, code = self.authorized(scope["headers"])
        if ok:
            return await self.app(scope, receive, send)
        error = error_body(message)
        error["error"]["code"] = code
        body = json.dumps(error).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer"), (b"connection", b"close")]})  # the body was not read
        await send({"type": "http.response.body", "body": body})
