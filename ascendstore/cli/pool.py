"""``ascendstore pool stats|ls|rm``: inspect and prune the pool.

Listing and prefix removal depend on the backend's declared capabilities
(``listing``, ``remove_by_prefix``); a backend without them gets a plain
message, not a stack trace. Selection is by raw key prefix, by GR user
(``{uid}@...`` keys; with ``--tenant`` that tenant's user, ``{tenant_id}~{uid}@...``)
or by tenant alone (the ``cache_salt`` whose chunk keys share ``as1@{tenant}@``).
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from ascendstore.cli.common import (
    EXIT_USAGE,
    BackendConfigOpt,
    BackendOpt,
    ConfigFileOpt,
    KvTransferConfigOpt,
    bounded,
    close_quietly,
    config_or_exit,
    console,
    fail,
    open_backend,
)
from ascendstore.contract import Backend, Status
from ascendstore.keys import KEY_VERSION, UserKey, tenant_id, tenant_prefix

app = typer.Typer(
    help="Inspect and prune the pool (backends that support listing and removal).", no_args_is_help=True
)

PrefixOpt = Annotated[str | None, typer.Option("--prefix", help="raw key prefix")]
UserOpt = Annotated[
    str | None,
    typer.Option("--user", help="GR user id: that user's keys (of --tenant's tenant; default: no tenant)"),
]
TenantOpt = Annotated[
    str | None,
    typer.Option(
        "--tenant", help="tenant salt (vLLM cache_salt): its chunk keys, or with --user its GR user"
    ),
]


def selection_prefix(prefix: str | None, user: str | None, tenant: str | None) -> str | None:
    """The key prefix the options select (None when none was given).

    ``--user`` with ``--tenant`` selects that tenant's GR user (a GR user is a uid
    of a tenant; users of the same uid under other tenants are not selected)."""
    given = [x for x in (prefix, user, tenant) if x is not None]
    if len(given) > 1 and not (len(given) == 2 and prefix is None):
        raise fail("give only one of --prefix, --user, --tenant (--user may take --tenant)", EXIT_USAGE)
    if user is not None:
        if user == KEY_VERSION:
            raise fail(f"user id {user!r} would select every chunk key; remove it with --prefix", EXIT_USAGE)
        try:
            return UserKey.user_prefix(user, tenant_id(tenant))
        except ValueError as exc:
            raise fail(str(exc), EXIT_USAGE) from None
    if tenant is not None:
        return tenant_prefix(tenant)
    return prefix


class _Opened:
    """Open the configured backend for one command; always closed after.

    Only a pool that exists, as it was made: a local pool no engine has open is an
    error naming it (not an empty pool made for the command), and one made with other
    options than the command was given is read as it is."""

    def __init__(self, **cfg_args: object) -> None:
        self.cfg = config_or_exit(**cfg_args)
        self.backend: Backend | None = None

    def __enter__(self) -> Backend:
        try:
            self.backend = open_backend(self.cfg, existing_only=True)
        except Exception as exc:
            raise fail(f"cannot open backend {self.cfg.backend!r}: {exc}") from None
        return self.backend

    def __exit__(self, *exc: object) -> None:
        close_quietly(self.backend)

    @property
    def timeout_s(self) -> float:
        return self.cfg.timeout_ms / 1000.0


@app.command()
def stats(
    config: ConfigFileOpt = None,
    kv_transfer_config: KvTransferConfigOpt = None,
    backend: BackendOpt = None,
    backend_config: BackendConfigOpt = None,
) -> None:
    """Backend counters (capacity, used bytes, objects, hits...) and health."""
    opened = _Opened(
        config_file=config,
        kv_transfer_config=kv_transfer_config,
        backend=backend,
        backend_config=backend_config,
    )
    with opened as be:
        health = bounded(be.health, opened.timeout_s, timeout_s=opened.timeout_s + 5, what="health")
        data = bounded(be.stats, timeout_s=opened.timeout_s + 5, what="stats")
    t = Table(title=f"pool {opened.cfg.backend!r}")
    t.add_column("stat")
    t.add_column("value", justify="right")
    t.add_row("health", health.status.name)
    for k, v in sorted(dict(data).items()):
        t.add_row(str(k), str(v))
    console.print(t)


@app.command("ls")
def ls(
    prefix: PrefixOpt = None,
    user: UserOpt = None,
    tenant: TenantOpt = None,
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="list at most this many keys")] = 100,
    config: ConfigFileOpt = None,
    kv_transfer_config: KvTransferConfigOpt = None,
    backend: BackendOpt = None,
    backend_config: BackendConfigOpt = None,
) -> None:
    """List keys (by prefix, user or tenant)."""
    sel = selection_prefix(prefix, user, tenant) or ""
    opened = _Opened(
        config_file=config,
        kv_transfer_config=kv_transfer_config,
        backend=backend,
        backend_config=backend_config,
    )
    with opened as be:
        if not be.capabilities.listing:
            raise fail(f"backend {opened.cfg.backend!r} cannot list keys (its capabilities.listing is False)")
        keys = bounded(
            lambda: list(be.list_keys(sel, limit)), timeout_s=opened.timeout_s + 5, what="list_keys"
        )
    for k in keys[:limit]:
        console.print(k, highlight=False, soft_wrap=True)
    console.print(
        f"[dim]{len(keys[:limit])} key(s)" + (" (limit reached)" if len(keys) >= limit else "") + "[/]"
    )


@app.command("rm")
def rm(
    keys: Annotated[list[str] | None, typer.Argument(help="exact keys to remove")] = None,
    prefix: PrefixOpt = None,
    user: UserOpt = None,
    tenant: TenantOpt = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="do not ask for confirmation")] = False,
    config: ConfigFileOpt = None,
    kv_transfer_config: KvTransferConfigOpt = None,
    backend: BackendOpt = None,
    backend_config: BackendConfigOpt = None,
) -> None:
    """Remove keys: exact KEYS, or everything under --prefix / --user / --tenant."""
    sel = selection_prefix(prefix, user, tenant)
    if bool(keys) == (sel is not None):
        raise fail("give either KEYS or one of --prefix/--user/--tenant", EXIT_USAGE)
    if sel == "":
        raise fail("an empty --prefix would remove everything; refusing", EXIT_USAGE)
    opened = _Opened(
        config_file=config,
        kv_transfer_config=kv_transfer_config,
        backend=backend,
        backend_config=backend_config,
    )
    if sel is not None and not yes:
        typer.confirm(f"remove every key starting with {sel!r} from {opened.cfg.backend!r}?", abort=True)
    with opened as be:
        t = opened.timeout_s
        if sel is not None:
            if not be.capabilities.remove_by_prefix:
                raise fail(
                    f"backend {opened.cfg.backend!r} cannot remove by prefix (capabilities.remove_by_prefix is False)"
                )
            status, n = bounded(be.remove_prefix, sel, t, timeout_s=t + 5, what="remove_prefix")
            if Status(status) is not Status.OK:
                raise fail(f"remove_prefix({sel!r}) returned {Status(status).name} after removing {n} key(s)")
            console.print(f"removed {n} key(s) under {sel!r}", highlight=False)
            return
        statuses = [
            Status(s) for s in bounded(be.remove, list(keys or []), t, timeout_s=t + 5, what="remove")
        ]
    removed = sum(s is Status.OK for s in statuses)
    missing = [k for k, s in zip(keys or [], statuses, strict=True) if s is Status.NOT_FOUND]
    errors = [
        (k, s) for k, s in zip(keys or [], statuses, strict=True) if s not in (Status.OK, Status.NOT_FOUND)
    ]
    console.print(
        f"removed {removed} key(s)" + (f", {len(missing)} not found" if missing else ""), highlight=False
    )
    if errors:
        raise fail("; ".join(f"{k}: {s.name}" for k, s in errors[:5]))
