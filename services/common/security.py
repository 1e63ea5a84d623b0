"""Who may talk to a service, and over what: TLS (mutual where asked) and
bearer tokens, for the analyzer's gRPC API, the collector's Flight endpoint
and the analyzer's tensor endpoint.

Settings (the service flags of the same meaning override them):

==================== =========================================================================
variable             meaning
==================== =========================================================================
LAYERDIFF_TOKEN      a client or worker: the bearer token it sends; a server: one token it accepts
LAYERDIFF_TOKEN_FILE a server: the tokens it accepts, one a line (``admin:TOKEN`` for a token that
                     may read every job; ``#`` starts a comment); a client without LAYERDIFF_TOKEN
                     sends the first token of the file
LAYERDIFF_TLS_CERT   a server: its certificate (PEM); a client: its own certificate, for mTLS
LAYERDIFF_TLS_KEY    the private key of that certificate (PEM)
LAYERDIFF_TLS_CA     a client: the CA that signed the servers (TLS is on when it is set); a
                     server: the CA client certificates must chain to (turns on mTLS)
LAYERDIFF_INSECURE   ``1``: serve without TLS or tokens on a non-loopback address (a trusted
                     development network only; refused otherwise)
==================== =========================================================================

Tokens are kept as SHA-256 digests and compared in constant time; a job
belongs to the digest of the token that submitted it.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerdiff.common.errors import LayerdiffError, Unauthenticated

AUTH_HEADER = "authorization"
ADMIN_PREFIX = "admin:"


def digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def _read(path: str, setting: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise LayerdiffError(f"cannot be read ({e.strerror or e})", file=path, field=setting) from None


def _setting(value: str | None, name: str) -> str | None:
    v = value if value is not None else os.environ.get(name)
    return v.strip() if v and v.strip() else None


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and names that resolve only there (localhost)."""
    h = host.strip("[]")
    if h in ("localhost", ""):
        return h == "localhost"
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        pass
    try:
        addrs = {str(a[4][0]) for a in socket.getaddrinfo(h, None)}   # IP families: already a str
    except OSError:
        return False
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


@dataclass(frozen=True)
class Identity:
    """Who called: the digest of the token presented ("" without tokens), and
    whether it may read every job."""
    owner: str
    admin: bool = False

    def may_read(self, owner: str) -> bool:
        return self.admin or not owner or hmac.compare_digest(self.owner, owner)


ANONYMOUS = Identity("", admin=True)   # a service without tokens: everyone may do everything


@dataclass(frozen=True)
class Tokens:
    users: tuple[str, ...]      # digests
    admins: tuple[str, ...]

    @classmethod
    def parse(cls, text: str, source: str) -> Tokens:
        users: list[str] = []
        admins: list[str] = []
        for n, line in enumerate(text.splitlines(), start=1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            admin = line.startswith(ADMIN_PREFIX)
            token = line[len(ADMIN_PREFIX):].strip() if admin else line
            if len(token) < 16:
                raise LayerdiffError(f"line {n}: a token must be at least 16 characters", file=source,
                                     field="LAYERDIFF_TOKEN_FILE")
            (admins if admin else users).append(digest(token))
        if not users and not admins:
            raise LayerdiffError("holds no token", file=source, field="LAYERDIFF_TOKEN_FILE")
        return cls(tuple(users), tuple(admins))

    def identify(self, presented: str | None) -> Identity:
        """The caller behind a presented token; Unauthenticated otherwise.
        Every stored digest is compared, whatever matches, so the time taken
        does not tell how close a guess was."""
        if not presented:
            raise Unauthenticated("no token: send 'authorization: Bearer TOKEN' (LAYERDIFF_TOKEN)")
        d = digest(presented)
        user = admin = False
        for s in self.users:
            user |= hmac.compare_digest(d, s)
        for s in self.admins:
            admin |= hmac.compare_digest(d, s)
        if not (user or admin):
            raise Unauthenticated("the token is not accepted by this service")
        return Identity(d, admin=admin)


def bearer(value: str | bytes | None) -> str | None:
    """The token of an ``authorization`` header value (``Bearer TOKEN``)."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


@dataclass(frozen=True)
class ServerSecurity:
    """What a server demands of its callers."""
    tokens: Tokens | None = None
    cert: bytes | None = None
    key: bytes | None = None
    client_ca: bytes | None = None

    @property
    def tls(self) -> bool:
        return self.cert is not None

    @classmethod
    def from_env(cls, *, token: str | None = None, token_file: str | None = None, cert: str | None = None,
                 key: str | None = None, ca: str | None = None) -> ServerSecurity:
        token, token_file = _setting(token, "LAYERDIFF_TOKEN"), _setting(token_file, "LAYERDIFF_TOKEN_FILE")
        cert, key, ca = (_setting(cert, "LAYERDIFF_TLS_CERT"), _setting(key, "LAYERDIFF_TLS_KEY"),
                         _setting(ca, "LAYERDIFF_TLS_CA"))
        tokens = None
        if token_file or token:
            text = _read(token_file, "LAYERDIFF_TOKEN_FILE").decode("utf-8", "replace") if token_file else ""
            if token:
                text += "\n" + token
            tokens = Tokens.parse(text, token_file or "LAYERDIFF_TOKEN")
        if bool(cert) != bool(key):
            raise LayerdiffError("a server certificate needs its key, and a key its certificate",
                                 field="LAYERDIFF_TLS_KEY" if cert else "LAYERDIFF_TLS_CERT")
        if ca and not cert:
            raise LayerdiffError("client certificates (mTLS) are checked only over TLS: give the server's own "
                                 "certificate and key too", field="LAYERDIFF_TLS_CERT")
        return cls(tokens, _read(cert, "LAYERDIFF_TLS_CERT") if cert else None,
                   _read(key, "LAYERDIFF_TLS_KEY") if key else None,
                   _read(ca, "LAYERDIFF_TLS_CA") if ca else None)

    def check_exposure(self, host: str, what: str) -> None:
        """Serving plain text, or without tokens, is for loopback (or an
        explicitly trusted development network)."""
        if is_loopback(host) or os.environ.get("LAYERDIFF_INSECURE", "").strip() == "1":
            return
        missing = [m for m, ok in (("TLS (LAYERDIFF_TLS_CERT, LAYERDIFF_TLS_KEY)", self.tls),
                                   ("tokens (LAYERDIFF_TOKEN_FILE)", self.tokens is not None)) if not ok]
        if missing:
            raise LayerdiffError(f"refusing to serve the {what} on {host} without {' and '.join(missing)}; "
                                 "set them, or LAYERDIFF_INSECURE=1 on a trusted development network",
                                 field="host")

    def identify(self, presented: str | None) -> Identity:
        return ANONYMOUS if self.tokens is None else self.tokens.identify(presented)

    # -- gRPC
    def grpc_credentials(self):
        import grpc

        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)

    # -- Arrow Flight
    def flight_scheme(self) -> str:
        return "grpc+tls" if self.tls else "grpc+tcp"

    def flight_kwargs(self) -> dict:
        if not self.tls:
            return {}
        import pyarrow.flight as flight

        kw: dict[str, Any] = {"tls_certificates": [flight.CertKeyPair(self.cert, self.key)]}
        if self.client_ca is not None:
            kw.update(verify_client=True, root_certificates=self.client_ca)
        return kw


@dataclass(frozen=True)
class ClientSecurity:
    """What a client presents: a token, and TLS when it knows the CA."""
    token: str | None = None
    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None

    @property
    def tls(self) -> bool:
        return self.ca is not None

    @classmethod
    def from_env(cls, *, token: str | None = None, ca: str | None = None) -> ClientSecurity:
        token = _setting(token, "LAYERDIFF_TOKEN")
        if token is None:
            token_file = _setting(None, "LAYERDIFF_TOKEN_FILE")
            if token_file:
                for line in _read(token_file, "LAYERDIFF_TOKEN_FILE").decode("utf-8", "replace").splitlines():
                    line = line.split("#", 1)[0].strip()
                    if line:
                        token = line[len(ADMIN_PREFIX):].strip() if line.startswith(ADMIN_PREFIX) else line
                        break
        ca = _setting(ca, "LAYERDIFF_TLS_CA")
        cert, key = _setting(None, "LAYERDIFF_TLS_CERT"), _setting(None, "LAYERDIFF_TLS_KEY")
        ca_pem = _read(ca, "LAYERDIFF_TLS_CA") if ca else None
        cert_pem: bytes | None = None
        key_pem: bytes | None = None
        if ca is not None and cert is not None and key is not None:    # mutual TLS
            cert_pem, key_pem = _read(cert, "LAYERDIFF_TLS_CERT"), _read(key, "LAYERDIFF_TLS_KEY")
        return cls(token, ca_pem, cert_pem, key_pem)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((AUTH_HEADER, f"Bearer {self.token}"),) if self.token else ()

    # -- gRPC
    def channel(self, address: str, options: list):
        import grpc

        if not self.tls:
            return grpc.insecure_channel(address, options=options)
        creds = grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                             certificate_chain=self.cert)
        return grpc.secure_channel(address, creds, options=options)

    # -- Arrow Flight
    def flight_location(self, address: str) -> str:
        return f"{'grpc+tls' if self.tls else 'grpc+tcp'}://{address}"

    def flight_connect_kwargs(self) -> dict:
        if not self.tls:
            return {}
        kw = {"tls_root_certs": self.ca}
        if self.cert is not None:
            kw.update(cert_chain=self.cert, private_key=self.key)
        return kw

    def flight_headers(self) -> list[tuple[bytes, bytes]]:
        return [(AUTH_HEADER.encode(), f"Bearer {self.token}".encode())] if self.token else []


def flight_middleware(security: ServerSecurity) -> dict:
    """The ``middleware`` argument of a Flight server that refuses a call
    without an accepted token before it starts (UNAUTHENTICATED); the
    caller's Identity is the middleware's ``identity``."""
    if security.tokens is None:
        return {}
    import pyarrow.flight as flight

    class _Auth(flight.ServerMiddleware):
        def __init__(self, identity: Identity) -> None:
            self.identity = identity

    class _Factory(flight.ServerMiddlewareFactory):
        def start_call(self, info, headers):
            values = {k.lower(): v for k, v in headers.items()}.get(AUTH_HEADER) or [None]
            try:
                return _Auth(security.identify(bearer(values[0])))
            except Unauthenticated as e:
                raise flight.FlightUnauthenticatedError(str(e)) from None

    return {"auth": _Factory()}


def grpc_interceptors(security: ServerSecurity, exempt: tuple[str, ...] = ("/grpc.health.v1.Health/",)) -> list:
    """Server interceptors that answer a call without an accepted token with
    UNAUTHENTICATED before the method runs (the standard health service,
    which probes call without credentials, is exempt)."""
    if security.tokens is None:
        return []
    import grpc

    class _TokenInterceptor(grpc.ServerInterceptor):
        def intercept_service(self, continuation, details):
            handler = continuation(details)
            if handler is None or details.method.startswith(exempt):
                return handler
            md = {k.lower(): v for k, v in (details.invocation_metadata or ())}
            try:
                security.identify(bearer(md.get(AUTH_HEADER)))
                return handler
            except Unauthenticated as e:
                message = str(e)

            def deny(_request, context):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

            kind = ("unary_unary" if handler.unary_unary else "unary_stream" if handler.unary_stream
                    else "stream_unary" if handler.stream_unary else "stream_stream")
            make = getattr(grpc, f"{kind}_rpc_method_handler")
            return make(deny, request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)

    return [_TokenInterceptor()]


def grpc_identity(security: ServerSecurity, context) -> Identity:
    """The caller of a gRPC method (already let in by the interceptor)."""
    md = {k.lower(): v for k, v in (context.invocation_metadata() or ())}
    return security.identify(bearer(md.get(AUTH_HEADER)))


def with_token(channel, security: ClientSecurity):
    """``channel`` sending the client's bearer token on every call."""
    if not security.token:
        return channel
    import collections

    import grpc

    header = security.metadata()

    class _Details(collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                                       "wait_for_ready", "compression")), grpc.ClientCallDetails):
        pass

    class _Token(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
        def _details(self, d):
            return _Details(d.method, d.timeout, tuple(d.metadata or ()) + header, d.credentials,
                            d.wait_for_ready, d.compression)

        def intercept_unary_unary(self, continuation, details, request):
            return continuation(self._details(details), request)

        def intercept_unary_stream(self, continuation, details, request):
            return continuation(self._details(details), request)

        def intercept_stream_unary(self, continuation, details, requests):
            return continuation(self._details(details), requests)

        def intercept_stream_stream(self, continuation, details, requests):
            return continuation(self._details(details), requests)

    return grpc.intercept_channel(channel, _Token())


def check_collector_allowed(address: str, allow: str | None = None) -> None:
    """The analyzer connects only to collectors on its allow-list
    (LAYERDIFF_COLLECTOR_ALLOW: ``host`` or ``host:port`` entries, comma-
    separated); without one, only to collectors on loopback."""
    from layerdiff.common.errors import PermissionDenied

    raw = allow if allow is not None else os.environ.get("LAYERDIFF_COLLECTOR_ALLOW", "")
    entries = {e.strip().lower() for e in raw.split(",") if e.strip()}
    host, _, port = address.strip().rpartition(":")
    host = host.strip("[]").lower() if host else address.strip().lower()
    if not entries:
        if is_loopback(host):
            return
        raise PermissionDenied(f"collector {address} is not on loopback, and this analyzer has no allow-list "
                               "(LAYERDIFF_COLLECTOR_ALLOW on the analyzer)", field="collector")
    if host in entries or f"{host}:{port}" in entries:
        return
    raise PermissionDenied(f"collector {address} is not on the analyzer's allow-list (LAYERDIFF_COLLECTOR_ALLOW)",
                           field="collector")
