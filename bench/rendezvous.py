"""Rendezvous time of the etcd3 backend against torch's c10d backend.

For each N (default 2, 8, 32, 64), N rendezvous handlers (no training workers)
join one rendezvous with min = max = N. The clock starts when every handler is
built (torch and etcd3 imported, the backend connected, as torch's c10d backend
connects its TCPStore client when built) and all are released at once from a
barrier; it stops when the last ``next_rendezvous()`` returns. The time
therefore includes what a real round includes: the state compare-and-set
traffic, the 1 s re-sync polls of torch's dynamic rendezvous, and the
MASTER_ADDR exchange through the backend's store.

Two ways to host the N handlers, as the issue allows; both are printed:

- processes: one forked process per handler, like one agent per node. On a
  small machine this measures CPU per request above all: 64 processes share
  the cores, so every compare-and-set cycle waits for CPU, and a gRPC call
  costs the Python client about 1 ms of CPU where a TCPStore call costs 0.3 ms.
- threads: one process hosts all N handlers, each on its own thread (as
  torch's own rendezvous tests do). The Python work of all handlers shares one
  interpreter lock, and the clients' network work runs outside it.

- etcd3: each handler has its own etcd client (its own gRPC channel), like a
  node; one local etcd member (started here on free ports, or --etcd-endpoint).
- c10d: torch's backend; one TCPStore server started here, as the host node
  would, and every handler a client of it.

Each (mode, backend, N) runs --repeats times (fresh run id each); the median is
printed, then the ratio etcd3/c10d. Targets: ratio <= 1.3 at N = 64 in each of three
back-to-back runs (issue 27; issue 4 asked 1.5), 64 under 10 s.

    python bench/rendezvous.py [--sizes 2,8,32,64] [--repeats 3] [--modes processes,threads]
                               [--etcd-endpoint HOST:PORT]

With --node-loss it also times, with real torchrun agents and the gloo test
job, the path from a node loss to the first step of the smaller world, in
parts: detection (kill -> a survivor's worker group fails), rendezvous
(-> "Rendezvous complete"), worker start (-> first step at the new world).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "rendezvous"))

from tests.ports import free_port  # noqa: E402  (after the path set-up above)


def _member(make_params, ready, results) -> None:  # type: ignore[no-untyped-def]
    """One simulated node (a forked process): build a handler, wait, join, report."""
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    try:
        handler = get_rendezvous_handler(make_params())
        ready.wait()
        info = handler.next_rendezvous()
        results.put((info.rank, time.time(), None))
    except BaseException as exc:  # reported by the parent
        results.put((-1, time.time(), repr(exc)))
    finally:
        # Flush the queue's feeder thread, then leave without an orderly
        # shutdown: that would run a close round, and the heartbeat threads
        # must not keep the process alive.
        results.close()
        results.join_thread()
        os._exit(0)


def time_in_processes(make_params, n: int) -> float:  # type: ignore[no-untyped-def]
    """Seconds for ``n`` handlers, one per forked process, to complete one round.

    Forking after torch is imported keeps 64 members cheap in memory.
    """
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    ready = ctx.Barrier(n + 1)
    results = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(make_params, ready, results), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    ready.wait(timeout=300)
    start = time.time()
    outcomes = [results.get(timeout=180) for _ in range(n)]
    for p in procs:
        p.join(timeout=30)
    errors = [e for _, _, e in outcomes if e]
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} members failed: {errors[0]}")
    ranks = sorted(r for r, _, _ in outcomes)
    if ranks != list(range(n)):
        raise RuntimeError(f"ranks {ranks} are not 0..{n - 1}")
    return max(t for _, t, _ in outcomes) - start


def time_in_threads(make_params, n: int) -> float:  # type: ignore[no-untyped-def]
    """Seconds for ``n`` handlers, one thread each in this process, to complete one round."""
    import threading

    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    handlers = [get_rendezvous_handler(make_params()) for _ in range(n)]
    ready = threading.Barrier(n + 1)
    outcomes: list[tuple[int, float, str | None]] = []

    def member(handler) -> None:  # type: ignore[no-untyped-def]
        ready.wait()
        try:
            outcomes.append((handler.next_rendezvous().rank, time.time(), None))
        except BaseException as exc:  # reported below
            outcomes.append((-1, time.time(), repr(exc)))

    threads = [threading.Thread(target=member, args=(h,), daemon=True) for h in handlers]
    for t in threads:
        t.start()
    ready.wait(timeout=300)
    start = time.time()
    for t in threads:
        t.join(timeout=180)
    # Off the clock: close the round, so that the handlers' heartbeat threads
    # stop and do not load the next measurement.
    closers = [threading.Thread(target=h.shutdown, daemon=True) for h in handlers]
    for t in closers:
        t.start()
    for t in closers:
        t.join(timeout=120)
    errors = [e for _, _, e in outcomes if e]
    if errors or len(outcomes) != n:
        raise RuntimeError(f"{n - len(outcomes) + len(errors)} of {n} members failed: {errors[:1]}")
    ranks = sorted(r for r, _, _ in outcomes)
    if ranks != list(range(n)):
        raise RuntimeError(f"ranks {ranks} are not 0..{n - 1}")
    return max(t for _, t, _ in outcomes) - start


MODES = {"processes": time_in_processes, "threads": time_in_threads}


def bench_handlers(sizes: list[int], repeats: int, etcd_endpoint: str, modes: list[str]) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    tcp_port = free_port()
    # The host node's TCPStore, in a process of its own: every c10d handler connects
    # to it as a client. Not a thread of this process, which forks the handlers: a
    # fork while the server thread holds a lock can deadlock the child (seen at N=8
    # and N=32 as a member that never reached the start barrier).
    server = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time, torch.distributed as d\n"
         "s = d.TCPStore('127.0.0.1', int(sys.argv[1]), is_master=True, multi_tenant=True, wait_for_workers=False)\n"
         "print('ready', flush=True)\n"
         "sys.stdin.read()\n",
         str(tcp_port)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    if server.stdout.readline().strip() != "ready":
        raise RuntimeError("the c10d TCPStore server process did not start")

    def params_for(backend: str, run_id: str, n: int):  # type: ignore[no-untyped-def]
        if backend == "etcd3":
            return functools.partial(RendezvousParameters, "etcd3", etcd_endpoint, run_id, n, n,
                                     join_timeout="120")
        # The etcd3 handler sets this in the process that builds it (threads mode);
        # c10d runs as torch runs it by default, the rank-0 handler hosting a store.
        os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        return functools.partial(RendezvousParameters, "c10d", f"127.0.0.1:{tcp_port}", run_id, n, n,
                                 is_host="false", join_timeout="120")

    print(f"{'mode':>9} {'N':>4} {'c10d s':>9} {'etcd3 s':>9} {'etcd3/c10d':>11}")
    # Processes first: threads mode leaves gRPC channels and TCPStore servers in
    # this process, and forking after that is unsafe.
    for mode in sorted(modes, key=list(MODES).index):
        for n in sizes:
            medians = {}
            for backend in ("c10d", "etcd3"):
                runs = [MODES[mode](params_for(backend, f"bench-{backend}-{n}-{uuid.uuid4().hex[:8]}", n), n)
                        for _ in range(repeats)]
                medians[backend] = statistics.median(runs)
            print(f"{mode:>9} {n:>4} {medians['c10d']:>9.2f} {medians['etcd3']:>9.2f} "
                  f"{medians['etcd3'] / medians['c10d']:>11.2f}", flush=True)
    server.stdin.close()  # the server exits at end of input
    server.wait(timeout=30)


_TS = re.compile(r"^[IWE](\d{4}) (\d\d:\d\d:\d\d\.\d+)")


def _log_times(log: Path, pattern: str) -> list[float]:
    """Timestamps (epoch seconds, this year) of agent log lines matching ``pattern``."""
    out = []
    year = datetime.now().year
    for line in log.read_text(errors="replace").splitlines():
        m = _TS.match(line)
        if m and re.search(pattern, line):
            stamp = datetime.strptime(f"{year}{m.group(1)} {m.group(2)}", "%Y%m%d %H:%M:%S.%f")
            out.append(stamp.timestamp())
    return out


def bench_node_loss(etcd_endpoint: str) -> None:
    """Node loss to first step of the new world, with torchrun agents and the gloo job."""
    from agents import read_jsonl, split_at_rank, torchrun_agent, wait_for

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        run_id = f"bench-loss-{uuid.uuid4().hex[:8]}"
        agents = [torchrun_agent(etcd_endpoint, run_id, out, nproc=1, nnodes="2:3", steps=60,
                                 step_time=0.2, name=f"agent{i}") for i in range(3)]
        try:
            wait_for(lambda: len([s for s in read_jsonl(out / "steps.jsonl") if s["world_size"] == 3]) >= 2,
                     300, "two steps at world size 3", agents)
            workers = [w for w in read_jsonl(out / "workers.jsonl") if w["world_size"] == 3]
            victim, survivors = split_at_rank(agents, workers, lambda rank: rank == 2)
            killed_at = time.time()
            victim.kill_tree()
            wait_for(lambda: any(s["world_size"] == 2 for s in read_jsonl(out / "steps.jsonl")), 300,
                     "a step at world size 2", survivors)
            # steps.jsonl has no timestamps; the progress file's mtime after the
            # first world-2 step is close enough for seconds-scale parts.
            first_step_at = (out / "progress").stat().st_mtime
            failed = min(t for a in survivors for t in _log_times(a.log, r"failed \(exitcode|Detected \d+ new nodes|Worker group FAILED"))
            rdzv = max(t for a in survivors for t in _log_times(a.log, r"Rendezvous complete") if t > failed)
            for a in survivors:
                a.wait(timeout=300)
        finally:
            for a in agents:
                if a.poll() is None:
                    a.kill_tree()
        print("\nnode loss -> first step of the new world (gloo job, 3 -> 2 nodes, keep_alive_interval=1):")
        print(f"  detection      {failed - killed_at:6.2f} s  (kill -> a survivor's workers fail)")
        print(f"  rendezvous     {rdzv - failed:6.2f} s  (-> last survivor's 'Rendezvous complete')")
        print(f"  worker start   {first_step_at - rdzv:6.2f} s  (-> first step at world 2, incl. torch import)")
        print("  checkpoint load   n/a     (the gloo job resumes from a counter file; see the trainer's events)")
        print(f"  total          {first_step_at - killed_at:6.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2,8,32,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="processes,threads", help="how to host the handlers: processes, threads or both")
    parser.add_argument("--etcd-endpoint", default=None, help="use this etcd instead of starting one")
    parser.add_argument("--node-loss", action="store_true", help="also time node loss -> first step")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        parser.error(f"--modes {args.modes!r}: give processes, threads, or both separated by a comma")
    # The handlers log every state change at INFO; keep the table readable.
    logging.basicConfig(level=logging.ERROR)

    # Import gRPC here, once, as the c10d side has torch's TCPStore loaded: the
    # forked members share the loaded modules. Each member builds its messages
    # when its handler connects, before the clock starts.
    import elastic_ft.rendezvous.etcd.session  # noqa: F401
    server = None
    endpoint = args.etcd_endpoint
    if endpoint is None:
        from etcd_server import EtcdServer

        tmp = tempfile.mkdtemp(prefix="bench-etcd-")
        server = EtcdServer(Path(tmp) / "data").start()
        endpoint = server.endpoint
    try:
        print(f"torch dynamic rendezvous, N handlers; etcd at {endpoint}; "
              f"median of {args.repeats}; {os.cpu_count()} CPUs")
        bench_handlers([int(s) for s in args.sizes.split(",")], args.repeats, endpoint, modes)
        if args.node_loss:
            bench_node_loss(endpoint)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
