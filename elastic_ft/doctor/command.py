"""``elastic-ft doctor``: its arguments and the order its checks run in, one printed line each.

Checks that need something not given (an etcd endpoint, a run id, a
checkpoint URI) print SKIP saying what to pass. Exit status 1 if any FAILed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Callable, Iterator

from elastic_ft.preflight.report import Result, exit_code


def max_nodes(text: str) -> int:
    """The maximum of ``--nnodes`` ``N`` or ``MIN:MAX`` (an argparse type: the message follows the flag)."""
    try:
        return int(text.rpartition(":")[2])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be N or MIN:MAX") from None


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("doctor", help="check this node for the classic multi-node failures (one line per check)")
    d.add_argument("--rdzv_endpoint", "--rdzv-endpoint", default=None, help="etcd HOST:PORT, as given to torchrun")
    d.add_argument("--rdzv_conf", "--rdzv-conf", default=None, help="k=v,... as given to torchrun (TLS, user, ...)")
    d.add_argument("--run_id", "--run-id", default=None, help="the run's id (versions and scratch objects live under it)")
    d.add_argument("--checkpoint_uri", "--checkpoint-uri", default=None, help="file:///dir or s3://bucket/prefix")
    d.add_argument("--nnodes", type=max_nodes, default=None, help="N or MIN:MAX as for torchrun (default: assume several nodes)")
    d.add_argument("--post", action="store_true", help="post this node's versions for the run (a few minutes' lease)")
    d.add_argument("--hostname", default=None, help="check this name instead of this node's hostname")
    d.set_defaults(func=run)


def checks(args: argparse.Namespace, environ: dict[str, str]) -> Iterator[Result]:
    """Every check's result, in order; each is produced (and printed) before the next starts."""
    from elastic_ft.doctor import ec2
    from elastic_ft.preflight import network

    multi = args.nnodes is None or args.nnodes > 1
    yield network.check_hostname(args.hostname, multi)
    yield from network.check_interfaces(environ, multi)
    yield from _rendezvous(args, environ)
    yield network.check_master_port(environ)
    yield from _store(args)
    yield ec2.check_imds(environ)


def _rendezvous(args: argparse.Namespace, environ: dict[str, str]) -> Iterator[Result]:
    from elastic_ft.doctor import rendezvous
    from elastic_ft.preflight import network

    if not args.rdzv_endpoint:
        yield Result("SKIP", "rendezvous", "no --rdzv_endpoint given (etcd HOST:PORT)")
        return
    try:
        options, client = rendezvous.open_client(args.rdzv_endpoint, rendezvous.parse_conf(args.rdzv_conf), environ)
    except ValueError as exc:
        yield Result("FAIL", "rendezvous", str(exc).replace("\n", " "), "correct --rdzv_endpoint / --rdzv_conf")
        return
    for e in options.connection.endpoints:
        yield network.rdzv_port_result(str(e), network.reachable(e.host, e.port))
    try:
        result = rendezvous.check_etcd(client)
        yield result
        yield _versions(args, options, client) if result.status == "PASS" else Result(
            "SKIP", "versions", "etcd does not answer")
    finally:
        client.close()


def _versions(args: argparse.Namespace, options, client) -> Result:
    from elastic_ft.preflight import versions

    if not args.run_id:
        return Result("SKIP", "versions", "no --run_id given: versions are posted and compared per run")
    prefix = versions.versions_prefix(options.run_prefix(args.run_id))
    if args.post:
        versions.post_versions(client, prefix, versions.node_name(), versions.local_versions())
    return versions.versions_result(versions.read_versions(client, prefix))


def _store(args: argparse.Namespace) -> Iterator[Result]:
    from elastic_ft.checkpoint.errors import StoreError
    from elastic_ft.checkpoint.store import check_uri, join_uri
    from elastic_ft.doctor import storage

    if not args.checkpoint_uri:
        yield Result("SKIP", "checkpoint_store", "no --checkpoint_uri given")
        yield storage.clock_result(None, 0.0)
        return
    try:
        check_uri(args.checkpoint_uri)
    except StoreError as exc:
        yield Result("FAIL", "checkpoint_store", str(exc), "write file:///abs/dir or s3://bucket/prefix")
        return
    uri = join_uri(args.checkpoint_uri, args.run_id) if args.run_id else args.checkpoint_uri
    probe = storage.probe_store(uri)
    yield storage.store_result(probe)
    yield storage.clock_result(probe.server_date, probe.local_time)


def run(args: argparse.Namespace, out: Callable[[str], None] | None = None) -> int:
    out = out or (lambda line: print(line, flush=True))
    # The etcd client logs each retry as a warning; the doctor's own line says it better.
    logging.getLogger("elastic_ft.rendezvous.etcd").setLevel(logging.ERROR)
    results = []
    for result in checks(args, dict(os.environ)):
        out(result.line())
        results.append(result)
    return exit_code(results)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="elastic-ft")
    add_parser(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(["doctor", *(argv or [])])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
