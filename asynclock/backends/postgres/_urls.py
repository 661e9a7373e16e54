"""``postgresql://`` URLs and options: what the backend is built from."""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass, replace
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

from .._kit import InvalidArgument, InvalidURL, Options, parse_hosts, redact, split_userinfo

SCHEMES = ("postgresql", "postgres")
EXAMPLE = "postgresql://user:password@127.0.0.1:5432/dbname?sslmode=require"
DEFAULT_PORT = 5432
#: PostgreSQL truncates identifiers and application names to NAMEDATALEN - 1 bytes.
NAME_MAX = 63
SSLMODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
#: libpq connection parameters handed to asyncpg as they are.
LIBPQ_OPTIONS = (
    "host",
    "port",
    "user",
    "password",
    "dbname",
    "database",
    "service",
    "passfile",
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "sslpassword",
    "sslcrl",
    "sslnegotiation",
    "ssl_min_protocol_version",
    "ssl_max_protocol_version",
    "target_session_attrs",
    "krbsrvname",
    "gsslib",
)
OWN_OPTIONS = (
    "schema",
    "application_name",
    "op_timeout",
    "connect_timeout",
    "max_idle",
    "max_waiting",
    "ssl",
    "pooler",
    "statement_cache_size",
)
#: ``?pooler=``: the pool modes a connection pooler may run in front of the server (``session``:
#: session locks on the client's own server sessions; ``transaction``: every hold in a
#: transaction of its own, ``_transactions.py``).
POOLER_MODES = ("session", "transaction")


@dataclass(frozen=True, slots=True)
class Settings:
    """What :meth:`PostgresBackend.from_url` read: the DSN for asyncpg, and our own options."""

    dsn: str
    schema: str
    application_name: str
    op_timeout: float
    connect_timeout: float
    max_idle: int
    ssl_context: ssl.SSLContext | None
    #: Waiters a client keeps in the server's queue, each on a connection; the others wait in
    #: the queue table without one.
    max_waiting: int = 8
    #: The pool mode of the connection pooler in front of the server, as the user states it
    #: (None: no pooler is expected, and one that is found is refused).
    pooler: str | None = None
    #: asyncpg's prepared statements per connection (0: none, for poolers that do not keep
    #: them, such as PgBouncer before 1.21 in transaction pooling: the default there).
    statement_cache_size: int = 16


def read_url(url: str, options: Mapping[str, object]) -> Settings:
    if not isinstance(url, str):
        raise InvalidURL(f"the PostgreSQL URL must be a str, for example {EXAMPLE}")
    base, _, query = url.partition("?")
    base, hash_sign, _ = base.partition("#")
    if hash_sign:
        raise InvalidURL(f"a PostgreSQL URL has no #fragment: {redact(url)!r}; expected {EXAMPLE}")
    scheme, _, rest = base.partition("://")
    if scheme.lower() not in SCHEMES:
        raise InvalidURL(f"{redact(url)!r} is not a PostgreSQL URL; expected {EXAMPLE}")
    netloc, _, path = rest.partition("/")
    hosts = split_userinfo(netloc)[1]
    if hosts:  # none: libpq's default (a local socket, or PGHOST)
        parse_hosts(hosts, default_port=DEFAULT_PORT, url=url, example=EXAMPLE)
    if "/" in path:
        raise InvalidURL(
            f"the path of {redact(url)!r} must be one database name; expected {EXAMPLE}"
        )
    try:
        parts = urlsplit(base)
        query_options = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
    except ValueError as exc:
        raise InvalidURL(
            f"malformed PostgreSQL URL {redact(url)!r}: {exc}; expected {EXAMPLE}"
        ) from None
    opts = Options({**query_options, **options}, "postgresql://")
    own = _own_options(opts)
    passed: dict[str, str] = {}
    for key in LIBPQ_OPTIONS:
        value = opts.optional_text(key)
        if value is not None:
            passed[key] = value
    sslmode = passed.get("sslmode")
    if sslmode is not None and sslmode not in SSLMODES:
        raise InvalidArgument(
            f"option 'sslmode' of postgresql:// must be one of {', '.join(SSLMODES)}, "
            f"got {sslmode!r}"
        )
    opts.finish((*OWN_OPTIONS, *LIBPQ_OPTIONS))
    dsn = parts._replace(query=urlencode(passed, quote_via=quote)).geturl()
    return replace(own, dsn=dsn)


def _own_options(opts: Options) -> Settings:
    schema = opts.text("schema", "public")
    if not schema or len(schema.encode("utf-8")) > NAME_MAX or "\x00" in schema:
        raise InvalidArgument(
            f"option 'schema' of postgresql:// must be a schema name of 1 to {NAME_MAX} "
            f"bytes, got {schema!r}"
        )
    application_name = opts.text("application_name", "asynclock")
    if len(application_name) > NAME_MAX or not all(" " <= char <= "~" for char in application_name):
        raise InvalidArgument(
            "option 'application_name' of postgresql:// must be printable ASCII of at most "
            f"{NAME_MAX} characters (pg_stat_activity shows it), got {application_name!r}"
        )
    ssl_context = opts.pop_raw("ssl")
    if ssl_context is not None and not isinstance(ssl_context, ssl.SSLContext):
        raise InvalidArgument(
            "option 'ssl' of postgresql:// must be an ssl.SSLContext (or put sslmode=... "
            f"and sslrootcert=... in the URL), got {type(ssl_context).__name__}"
        )
    pooler = opts.optional_text("pooler")
    if pooler is not None and pooler not in POOLER_MODES:
        raise InvalidArgument(
            f"option 'pooler' of postgresql:// must be 'session' (PgBouncer's pool_mode = "
            "session: session locks on the client's own server sessions) or 'transaction' "
            "(pool_mode = transaction: each lock held in a transaction of its own), got "
            f"{pooler!r}; statement pooling cannot hold a lock: it ends every transaction "
            "after one statement"
        )
    return Settings(
        dsn="",
        schema=schema,
        application_name=application_name,
        op_timeout=opts.number("op_timeout", 5.0, minimum=0.001),
        connect_timeout=opts.number("connect_timeout", 5.0, minimum=0.001),
        max_idle=opts.whole("max_idle", 4, minimum=0),
        ssl_context=ssl_context,
        max_waiting=opts.whole("max_waiting", 8, minimum=0),
        pooler=pooler,
        # Transaction pooling hands each transaction any server session, where a prepared
        # statement of another one is missing (PgBouncer before 1.21 keeps none).
        statement_cache_size=opts.whole(
            "statement_cache_size", 0 if pooler == "transaction" else 16, minimum=0
        ),
    )
