"""``arc-operator`` (``python -m arc_operator``): the operator, with one copy acting at a time.

It runs kopf with the handlers of ``arc_operator.handlers`` (registered on kopf's default
registry when imported, as ``kopf run -m arc_operator.handlers`` does), standalone.

With ``--lease-name`` the process is a candidate in a Lease election
(``arc_operator.leadership``). A follower serves ``/healthz`` on the liveness address (so the
kubelet neither restarts it nor holds up a rollout) and makes no API call but the Lease's read
and write every retry period. The leader stops that server and runs kopf, which serves
``/healthz`` itself, while it renews the Lease in the background. A leader that cannot renew
within the renew deadline stops kopf and exits 1 (its container restarts as a follower); on
SIGTERM or SIGINT it stops kopf gracefully, releases the Lease and exits 0. Without
``--lease-name`` kopf runs at once, with no election (a developer's run, the kmock tests).

Invalid options exit 2 with a message naming the option.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import os
import re
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import kopf
from aiohttp import web

from arc_operator.kube import KubeApi, login
from arc_operator.leadership import (
    LEASE_DURATION_S,
    RENEW_DEADLINE_S,
    RETRY_PERIOD_S,
    LeaseElector,
    default_identity,
)

HANDLERS = "arc_operator.handlers"
# How long kopf may take to stop once the lease is lost: it is stopped before the lease can
# expire for the others (LEASE_DURATION_S after the last renewal), with a retry period to spare.
LOST_STOP_GRACE_S = LEASE_DURATION_S - RENEW_DEADLINE_S - RETRY_PERIOD_S
LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS_LABEL = re.compile(rf"^(?=.{{1,63}}$){LABEL}$")
DNS_SUBDOMAIN = re.compile(rf"^(?=.{{1,253}}$){LABEL}(\.{LABEL})*$")

logger = logging.getLogger("arc_operator")


@dataclass(frozen=True)
class Options:
    namespaces: tuple[str, ...]
    all_namespaces: bool
    liveness: str | None
    lease_name: str | None
    lease_namespace: str | None
    verbose: bool
    debug: bool
    quiet: bool


def _liveness_url(value: str) -> str:
    """kopf's liveness endpoint: ``http://HOST:PORT/PATH``."""
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - parsing the port raises on a bad one
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{value!r} is not a URL: {error}") from None
    if parts.scheme != "http" or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{value!r} is not an http://HOST[:PORT]/PATH URL")
    return value


def _name(pattern: re.Pattern[str], what: str) -> Callable[[str], str]:
    def check(value: str) -> str:
        if not pattern.match(value):
            raise argparse.ArgumentTypeError(f"{value!r} is not a {what}")
        return value

    return check


_lease_name = _name(DNS_SUBDOMAIN, "valid object name (lower-case RFC 1123 subdomain)")
_namespace_name = _name(DNS_LABEL, "valid namespace name (lower-case RFC 1123 label)")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="arc-operator",
        description="The arc-serving operator (kopf, standalone), optionally leader-elected "
        "on a Lease so that one copy acts at a time.",
    )
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "-n", "--namespace", dest="namespaces", action="append", metavar="NS",
        help="watch this namespace (repeatable; kopf's patterns allowed)",
    )  # fmt: skip
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument(
        "-L", "--liveness", type=_liveness_url, metavar="URL",
        help="serve /healthz here, e.g. http://0.0.0.0:8080/healthz (followers too)",
    )  # fmt: skip
    parser.add_argument(
        "--lease-name", type=_lease_name, metavar="NAME",
        help="elect one leader on this coordination.k8s.io Lease; without it, no election",
    )  # fmt: skip
    parser.add_argument(
        "--lease-namespace", type=_namespace_name, metavar="NS",
        help="the Lease's namespace (default: $POD_NAMESPACE)",
    )  # fmt: skip
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG")
    verbosity.add_argument("-d", "--debug", action="store_true", help="log at DEBUG, asyncio too")
    verbosity.add_argument("-q", "--quiet", action="store_true", help="log warnings and errors")
    return parser


def parse_args(argv: Sequence[str] | None, env: Mapping[str, str] = os.environ) -> Options:
    """The options; exits 2 with a message naming the option when one is invalid."""
    cli = parser()
    args = cli.parse_args(argv)
    namespace = args.lease_namespace
    if namespace is None and env.get("POD_NAMESPACE"):
        try:
            namespace = _namespace_name(env["POD_NAMESPACE"])
        except argparse.ArgumentTypeError as error:
            cli.error(f"POD_NAMESPACE (the default of --lease-namespace): {error}")
    if args.lease_name is not None and namespace is None:
        cli.error("--lease-name needs --lease-namespace (or POD_NAMESPACE)")
    if args.lease_name is None and args.lease_namespace is not None:
        cli.error("--lease-namespace needs --lease-name")
    return Options(
        namespaces=tuple(args.namespaces or ()),
        all_namespaces=args.all_namespaces,
        liveness=args.liveness,
        lease_name=args.lease_name,
        lease_namespace=namespace if args.lease_name is not None else None,
        verbose=args.verbose,
        debug=args.debug,
        quiet=args.quiet,
    )


def run_kopf(
    options: Options, stop_flag: asyncio.Event | None, ready_flag: asyncio.Event | None = None
) -> Coroutine[Any, Any, None]:
    """kopf as ``kopf run -m arc_operator.handlers --standalone`` runs it."""
    return kopf.operator(
        standalone=True,
        clusterwide=options.all_namespaces,
        namespaces=options.namespaces,
        liveness_endpoint=options.liveness,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )


async def serve_follower_health(url: str) -> web.AppRunner:
    """``/healthz`` (the URL's path) answering 200 while this process follows."""

    async def healthy(_: web.Request) -> web.Response:
        return web.json_response({"role": "follower"})

    parts = urlsplit(url)
    app = web.Application()
    app.router.add_get(parts.path or "/", healthy)
    # kopf's own health server binds the same address once this one is closed.
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, parts.hostname, parts.port or 80).start()
    return runner


def _on_signals(callback: Callable[[signal.Signals], Any]) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, callback, sig)


async def _when_set(event: asyncio.Event, action: Callable[[], Any]) -> None:
    await event.wait()
    action()


async def _first(main: Awaitable[Any], stop: asyncio.Event) -> bool:
    """Await ``main`` unless ``stop`` is set first (``main`` is then cancelled): whether
    ``main`` finished."""
    task = asyncio.ensure_future(main)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    for pending in (task, stopped):
        pending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pending
    return task.done() and not task.cancelled()


async def lead(options: Options, elector: LeaseElector) -> int:
    """Follow until elected, then run kopf while renewing; the exit status."""
    signalled = asyncio.Event()
    stop_flag = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        logger.info(f"{sig.name} received: stopping")
        signalled.set()
        stop_flag.set()

    _on_signals(on_signal)
    health = await serve_follower_health(options.liveness) if options.liveness else None
    try:
        elected = await _first(elector.acquire(), signalled)
    finally:
        if health is not None:
            await health.cleanup()
    if not elected:
        return 0
    if signalled.is_set():  # elected as the signal came
        await elector.release()
        return 0

    renewing = asyncio.create_task(elector.keep_leading(), name="lease renewal")
    renewing.add_done_callback(lambda _: stop_flag.set())
    # kopf puts its own SIGINT/SIGTERM handlers in place of ours as it starts: ours again once
    # it is ready, so that a signal stops kopf through the stop flag (after a signal of its
    # own, kopf waits 5 s for its stop-flag waiter before it returns).
    kopf_ready = asyncio.Event()
    reclaiming = asyncio.create_task(_when_set(kopf_ready, lambda: _on_signals(on_signal)))
    # Created last: kopf leaves running the tasks that existed before it started.
    operating = asyncio.create_task(run_kopf(options, stop_flag, kopf_ready), name="kopf")
    await asyncio.wait({operating, renewing}, return_when=asyncio.FIRST_COMPLETED)
    reclaiming.cancel()
    _on_signals(on_signal)
    if renewing.done() and not renewing.cancelled():
        logger.error(f"{elector}: leadership lost ({renewing.result()}); stopping kopf")
        done, _ = await asyncio.wait({operating}, timeout=LOST_STOP_GRACE_S)
        if not done:
            # Acting on past this point could overlap the next leader: stop now, not cleanly.
            logger.error(f"kopf did not stop within {LOST_STOP_GRACE_S:g} s; exiting")
            logging.shutdown()
            os._exit(1)
        return 1
    # kopf stopped first: on a signal or a failure. Either way the lease goes to a follower
    # at once.
    renewing.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await renewing
    try:
        async with asyncio.timeout(RENEW_DEADLINE_S):
            await elector.release()
    except Exception as error:  # the lease then expires on its own
        logger.warning(f"{elector}: release failed: {error!r}")
    operating.result()  # kopf's failure, if it failed
    return 0


async def operate(options: Options) -> int:
    if options.lease_name is None or options.lease_namespace is None:
        await run_kopf(options, stop_flag=None)
        return 0
    settings = kopf.OperatorSettings()
    try:
        api = KubeApi(lambda: login(settings))
    except kopf.LoginError as error:
        logger.error(str(error))
        return 1
    elector = LeaseElector(api, options.lease_namespace, options.lease_name, default_identity())
    try:
        return await lead(options, elector)
    finally:
        await api.close()


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    # As `kopf run` logs: each object's messages prefixed with its namespace/name.
    kopf.configure(
        debug=options.debug, verbose=options.verbose, quiet=options.quiet, log_prefix=True
    )
    # A bad ARC_OPERATOR_* setting stops the import, naming it, before any election.
    importlib.import_module(HANDLERS)
    # asyncio's own loop, the one the operator image has, even where uvloop is installed (as
    # `kopf run` would take it): under uvloop an operator cut off from the API server died of
    # SIGABRT amid "Bad file descriptor" connect errors instead of exiting 1 at its deadline.
    with asyncio.Runner() as runner:
        return runner.run(operate(options))


if __name__ == "__main__":
    sys.exit(main())
