"""The etcd control plane at scale: N etcd3 rendezvous agents on one local etcd, no training.

Each agent is one real handler of ours (``create_handler``, its own etcd client and gRPC channel,
torch's keep-alive thread) driven as torch's elastic agent drives it: ``next_rendezvous()``, then a
monitor loop that polls ``num_nodes_waiting()`` every ``--monitor-interval`` (torchrun's default,
0.1 s) and joins the next round when it is above 0. All N agents are threads of this process, on
one etcd member started here on free ports (tests/rendezvous/etcd_server.py), whose Prometheus
``/metrics`` (on its client URL) gives the request and byte counts. Measured per N:

- ``round_s``: all N released at once from a barrier (handlers built, connected, lease granted
  beforehand, as torchrun builds its handler before the first round) until the last
  ``next_rendezvous()`` returns. min_nodes = N - 1, max_nodes = N: the first round completes when
  the N-th joins; the re-round without the lost one completes ``last_call_timeout`` (3 s) after
  N - 1 are in, as for ``--nnodes MIN:MAX`` in production.
- ``requests_per_round`` / ``bytes_per_round``: the change of etcd's
  ``grpc_server_msg_received_total`` (every request message, stream messages included) and of
  ``etcd_network_client_grpc_received_bytes_total + ..._sent_bytes_total`` over that round.
- steady state, ``--steady-s`` seconds (default 20) after the round, every agent keeping alive and
  monitoring: ``heartbeat_writes_per_s`` (``etcd_mvcc_put_total``: puts etcd applied, each one a new
  revision of the history it keeps until compacted), ``heartbeat_bytes_per_s`` (bytes etcd received
  from the clients, ``etcd_network_client_grpc_received_bytes_total``: the keep-alive writes carry the
  whole state), ``steady_rounds`` (rounds that did not hold: a keep-alive later than its expiry, the
  host overloaded), ``read_bytes_per_s`` (sent to the clients: the monitor's state reads), ``put_bytes_per_s``
  (``etcd_debugging_mvcc_total_put_size_in_bytes``: what the history grows by), ``lease_renewals_per_s``,
  and ``cas_retries_per_s``: failed compare-and-sets of the rendezvous state, counted by wrapping
  the backend's ``set_state`` in this process only (the product has no such counter; a failed one is
  a write that lost the race and is retried by torch after merging the winner's state).
- ``db_bytes``: ``etcd_mvcc_db_total_size_in_bytes`` at the end of the steady state, under the
  compaction given by ``--compaction`` (``none``: etcd's default, no compaction; ``infra``: the flags
  infra/aws/etcd.yaml gives its members, compaction and quota; or ``periodic:RET`` /
  ``revision:RET``), and ``db_bytes_series`` ([seconds into the window, bytes], 20 samples).
  Compaction frees pages for reuse, it does not shrink the file: a ``db_bytes_series`` that levels off
  over a long ``--steady-s`` is the proof of a bound, a short window only shows the growth rate.
- ``reround_s``: one agent lost as a dead node is (its keep-alive timer cancelled, its monitor loop
  ended, its etcd connection closed; no leave, no close) until every survivor's ``next_rendezvous()``
  returned a round of world size N - 1 with ranks 0..N-2. "Re-formed" is exactly that: each
  survivor's monitor saw the loss (``num_nodes_waiting() > 0``, the keep-alive older than
  ``keep_alive_interval * keep_alive_max_attempt``, 6 s by default) and joined, and the round they
  joined completed without the lost node. ``detect_s`` is the part until the first survivor saw it.

On this machine (2 cores, shared) the N agents share one interpreter lock: at 512 the Python work
of 512 keep-alive timers and 512 monitor loops is serialised, so round and re-round times are an
upper bound of what 512 separate nodes would see, and etcd itself shares the same 2 cores. The
request and byte counts do not depend on that. Keep-alive interval and monitor interval are the
rendezvous' and torchrun's defaults unless given (``--keep-alive-interval 1`` doubles the write rate
for a quicker steady state; the rates scale with 1 / interval).

    python bench/control_plane.py [--agents 32,128,512] [--steady-s 20] [--compaction none|infra|...]
                                  [--keep-alive-interval 2] [--monitor-interval 0.1] [--json]

``--json`` prints one JSON object per agent count (one line each; one object for one count) with
``agents``, ``round_s``, ``reround_s``, ``requests_per_round``, ``heartbeat_writes_per_s``,
``heartbeat_bytes_per_s``, ``cas_retries_per_s``, ``db_bytes`` and the other figures above;
otherwise a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.rendezvous.etcd_server import EtcdServer  # noqa: E402  (after the path set-up above)

INFRA_TEMPLATE = ROOT / "infra" / "aws" / "etcd.yaml"
MAX_AGENTS = 512


# -- etcd's own counters ------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape(endpoint: str) -> dict[str, float]:
    """etcd's Prometheus counters at ``http://endpoint/metrics``, each name summed over its labels."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            totals[m.group(1)] = totals.get(m.group(1), 0.0) + float(m.group(3))
    return totals


def delta(after: dict[str, float], before: dict[str, float], *names: str) -> float:
    return sum(after.get(n, 0.0) - before.get(n, 0.0) for n in names)


REQUESTS = "grpc_server_msg_received_total"
RECEIVED = "etcd_network_client_grpc_received_bytes_total"
SENT = "etcd_network_client_grpc_sent_bytes_total"
PUTS = "etcd_mvcc_put_total"
PUT_BYTES = "etcd_debugging_mvcc_total_put_size_in_bytes"
LEASE_RENEWED = "etcd_debugging_lease_renewed_total"
DB_BYTES = "etcd_mvcc_db_total_size_in_bytes"
DB_IN_USE = "etcd_mvcc_db_total_size_in_use_in_bytes"


# -- the etcd member and its flags --------------------------------------------------------------

def infra_flags(template: Path = INFRA_TEMPLATE) -> tuple[str, ...]:
    """The compaction and quota flags infra/aws/etcd.yaml gives its members (from its ETCD_* lines)."""
    flags = []
    for name in ("AUTO_COMPACTION_MODE", "AUTO_COMPACTION_RETENTION", "QUOTA_BACKEND_BYTES"):
        m = re.search(rf"^\s*ETCD_{name}=(\S+)\s*$", template.read_text(), re.M)
        if m:
            flags += [f"--{name.lower().replace('_', '-')}", m.group(1)]
    return tuple(flags)


def compaction_flags(spec: str) -> tuple[str, ...]:
    """``none``, ``infra``, ``periodic:RETENTION`` or ``revision:RETENTION`` as etcd flags."""
    if spec == "none":
        return ()
    if spec == "infra":
        return infra_flags()
    mode, _, retention = spec.partition(":")
    if mode not in ("periodic", "revision") or not retention:
        raise ValueError(f"--compaction {spec!r}: give none, infra, periodic:RETENTION (e.g. periodic:5m) "
                         f"or revision:RETENTION (e.g. revision:10000)")
    return ("--auto-compaction-mode", mode, "--auto-compaction-retention", retention)


@contextlib.contextmanager
def etcd_member(flags: tuple[str, ...] = ()) -> Iterator[EtcdServer]:
    """A fresh etcd member (own ports, own data dir) with ``flags``, stopped and removed after."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-ctlplane-"))
    server = EtcdServer(tmp / "data", extra_args=flags).start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


# -- compare-and-set outcomes, counted in this process only -------------------------------------

class CasCounts:
    """Calls of the rendezvous backend's ``set_state`` and how many did not write (lost the race)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls = 0
        self.failed = 0

    def add(self, written: bool) -> None:
        with self._lock:
            self.calls += 1
            self.failed += not written

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.calls, self.failed


@contextlib.contextmanager
def counting_cas() -> Iterator[CasCounts]:
    """Wrap ``EtcdV3RendezvousBackend.set_state`` (torch's backend contract) to count its outcomes."""
    from elastic_ft.rendezvous.backend import EtcdV3RendezvousBackend

    counts = CasCounts()
    original = EtcdV3RendezvousBackend.set_state

    def set_state(self, state, token=None):  # type: ignore[no-untyped-def]
        result = original(self, state, token)
        counts.add(result is not None and bool(result[2]))
        return result

    EtcdV3RendezvousBackend.set_state = set_state  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        EtcdV3RendezvousBackend.set_state = original  # type: ignore[method-assign]


# -- the agents ---------------------------------------------------------------------------------

@dataclass
class Joined:
    """One return of ``next_rendezvous()``: when (time.monotonic()), the rank, the world size."""

    at: float
    rank: int
    world_size: int


class Agent:
    """One node's rendezvous side as torch's agent runs it: join, then monitor and rejoin on a change."""

    def __init__(self, handler: Any, monitor_interval: float) -> None:
        self.handler = handler
        self.monitor_interval = monitor_interval
        self.rounds: list[Joined] = []
        self.saw_change_at: float | None = None
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _join(self) -> None:
        info = self.handler.next_rendezvous()
        self.rounds.append(Joined(time.monotonic(), info.rank, info.world_size))

    def _run(self) -> None:
        try:
            self._join()
            while not self.stop.wait(self.monitor_interval):
                if self.handler.num_nodes_waiting() > 0 and not self.stop.is_set():
                    if self.saw_change_at is None:
                        self.saw_change_at = time.monotonic()
                    self._join()
        except BaseException as exc:  # reported by the bench
            self.error = exc

    def lose(self) -> None:
        """Die as a node does: no more keep-alives, no leave, the connection dropped."""
        from elastic_ft.rendezvous.torch_internals import stop_heartbeats

        from elastic_ft.rendezvous.etcd.errors import EtcdClientError

        def dead(what: str, fn: Any) -> Any:
            raise EtcdClientError(f"{what}: this agent is dead (bench)")

        self.stop.set()
        stop_heartbeats(self.handler)
        # A closed client reconnects when used again, and an agent lost while it is inside
        # next_rendezvous() (a round a starved keep-alive broke) would go on joining and refreshing its
        # liveness lease from that thread: a dead node's etcd calls all fail.
        self.handler.etcd_client._failover.call = dead
        self.handler.etcd_client.close()

    def quit(self) -> None:
        """Off the clock, at the end: stop like :meth:`lose` (a close round of 512 would only cost time)."""
        self.lose()


def build_agents(endpoint: str, run_id: str, n: int, *, keep_alive_interval: int, monitor_interval: float,
                 join_timeout_s: int = 600) -> list[Agent]:
    """``n`` handlers built with ``create_handler`` (each connects and gets its lease now), min N-1, max N.

    ``join_timeout_s``: an agent still in ``next_rendezvous()`` then gives up by itself (the bench sets
    it just past its own wait, so no agent thread outlives a count whose round did not form); a call
    that finds the bench's etcd stopped gives up after 10 s (``retry_timeout``).
    """
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elastic_ft.rendezvous.handler import create_handler

    params = RendezvousParameters("etcd3", endpoint, run_id, max(1, n - 1), n, join_timeout=str(join_timeout_s),
                                  keep_alive_interval=str(keep_alive_interval), retry_timeout="10")
    return [Agent(create_handler(params), monitor_interval) for _ in range(n)]


def _check(agents: list[Agent], what: str) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

    errors = [a.error for a in agents if a.error is not None]
    if errors and all(isinstance(e, RendezvousTimeoutError) for e in errors):
        # Their join timeout passed before this loop saw its own (at 512 threads it waits long for the GIL).
        raise RoundNotFormed(what, sum(bool(a.rounds) for a in agents), len(agents), agents[0].handler.settings
                             .timeout.join.total_seconds())
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(agents)} agents failed during {what}: {errors[0]!r}")


def _seen(agents: list[Agent]) -> str:
    """What the newest state one agent synced shows (for the progress lines): round, participants, waiting."""
    from elastic_ft.rendezvous.torch_internals import state_holder

    state = max((state_holder(a.handler).state for a in agents), key=lambda s: (s.round, len(s.participants)))
    return (f"round {state.round}: {len(state.participants)} participants, complete {state.complete}, "
            f"{len(state.wait_list)} waiting, {len(state.last_heartbeats)} heartbeats")


class RoundNotFormed(RuntimeError):
    """Not every agent returned from ``next_rendezvous()`` in time: a figure (the design does not scale), not a crash."""

    def __init__(self, what: str, joined: int, agents: int, timeout: float) -> None:
        super().__init__(f"{what}: only {joined} of {agents} agents joined within {timeout:g} s")
        self.joined = joined


def wait_for_round(agents: list[Agent], count: int, world_size: int, timeout: float, what: str,
                   size_decides: bool = False) -> float:
    """Block until every agent has joined ``count`` rounds; the time (monotonic) the last returned.

    With ``size_decides``, ``count`` is the least: the wait goes on until every agent's newest round
    is ``world_size`` (after a loss, a round of the old size that a late keep-alive broke, the host's
    threads starved of the interpreter lock, may come in between: it is not the re-round).

    Raises:
        RoundNotFormed: the time ran out.
        RuntimeError: an agent failed, or the round is not ``world_size`` with ranks 0..N-1.
    """
    def waiting(a: Agent) -> bool:
        return len(a.rounds) < count or (size_decides and a.rounds[-1].world_size != world_size)

    deadline = time.monotonic() + timeout
    told = time.monotonic()
    while any(waiting(a) for a in agents):
        _check(agents, what)
        if time.monotonic() - told > 15:
            told = time.monotonic()
            print(f"  ... {what}: {sum(not waiting(a) for a in agents)} of {len(agents)} joined; "
                  f"{_seen(agents)}", file=sys.stderr, flush=True)
        if time.monotonic() > deadline:
            raise RoundNotFormed(what, sum(not waiting(a) for a in agents), len(agents), timeout)
        time.sleep(0.05)
    _check(agents, what)
    last = [a.rounds[-1] if size_decides else a.rounds[count - 1] for a in agents]
    ranks = sorted(j.rank for j in last)
    sizes = {j.world_size for j in last}
    if sizes != {world_size} or ranks != list(range(world_size)):
        raise RuntimeError(f"{what}: world sizes {sorted(sizes)}, ranks {ranks[:5]}..., expected {world_size}")
    return max(j.at for j in last)


@dataclass
class Figures:
    agents: int
    round_s: float
    reround_s: float
    detect_s: float
    requests_per_round: float
    bytes_per_round: float
    heartbeat_writes_per_s: float
    heartbeat_bytes_per_s: float
    read_bytes_per_s: float
    put_bytes_per_s: float
    state_bytes: float
    lease_renewals_per_s: float
    set_state_calls_per_s: float
    cas_retries_per_s: float
    db_bytes: float
    db_in_use_bytes: float
    db_bytes_series: list
    steady_rounds: int
    steady_s: float
    keep_alive_interval: int
    monitor_interval: float
    etcd_flags: str


def measure(endpoint: str, n: int, *, steady_s: float = 20.0, keep_alive_interval: int = 2,
            monitor_interval: float = 0.1, lose: bool = True, etcd_flags: tuple[str, ...] = (),
            round_timeout: float = 600.0) -> Figures:
    """Every figure of the module docstring for ``n`` agents on the etcd at ``endpoint``.

    ``lose=False`` skips the re-round (``reround_s`` and ``detect_s`` are then NaN).
    """
    if not 2 <= n <= MAX_AGENTS:
        raise ValueError(f"agents {n}: give 2 to {MAX_AGENTS}")
    run_id = f"ctlplane-{n}-{uuid.uuid4().hex[:8]}"
    with counting_cas() as cas:
        agents = build_agents(endpoint, run_id, n, keep_alive_interval=keep_alive_interval,
                              monitor_interval=monitor_interval, join_timeout_s=int(round_timeout) + 30)
        try:
            before = scrape(endpoint)
            start = time.monotonic()
            for a in agents:
                a.thread.start()
            done = wait_for_round(agents, 1, n, round_timeout, f"the first round of {n}")
            round_s = done - start
            after_round = scrape(endpoint)

            # Steady state: from one keep-alive interval after the round (the last joiners' first beats).
            time.sleep(keep_alive_interval)
            s0, c0, t0 = scrape(endpoint), cas.snapshot(), time.monotonic()
            # db size sampled 20 times over the window: bounded or growing, not only where it ended.
            db_series = []
            for i in range(1, 21):
                time.sleep(max(0.0, t0 + steady_s * i / 20 - time.monotonic()))
                db_series.append([round(time.monotonic() - t0, 1), scrape(endpoint).get(DB_BYTES, 0.0)])
            s1, c1, t1 = scrape(endpoint), cas.snapshot(), time.monotonic()
            _check(agents, "the steady state")
            # A round that did not hold (a keep-alive later than interval x 3 s: the host is overloaded) is
            # a figure too; the re-round below then starts from the round the agents are in.
            extra_rounds = max(len(a.rounds) for a in agents) - 1
            if extra_rounds:
                wait_for_round(agents, extra_rounds + 1, n, round_timeout, f"the round of {n} after a spurious loss")
            span = t1 - t0
            puts = delta(s1, s0, PUTS)

            reround_s = detect_s = float("nan")
            if lose:
                victim, survivors = agents[0], agents[1:]
                lost_at = time.monotonic()
                victim.lose()
                done = wait_for_round(survivors, extra_rounds + 2, n - 1, round_timeout,
                                      f"the round of {n - 1} after a loss", size_decides=True)
                reround_s = done - lost_at
                detect_s = min(a.saw_change_at for a in survivors if a.saw_change_at is not None) - lost_at
        finally:
            for a in agents:
                with contextlib.suppress(Exception):
                    a.quit()
            # An agent still joining ends at its join timeout; wait for it while etcd still answers.
            give_up = time.monotonic() + 90
            for a in agents:
                a.thread.join(timeout=max(0.0, give_up - time.monotonic()))
    return Figures(
        agents=n,
        round_s=round(round_s, 3),
        reround_s=round(reround_s, 3),
        detect_s=round(detect_s, 3),
        requests_per_round=delta(after_round, before, REQUESTS),
        bytes_per_round=delta(after_round, before, RECEIVED, SENT),
        heartbeat_writes_per_s=round(puts / span, 2),
        heartbeat_bytes_per_s=round(delta(s1, s0, RECEIVED) / span, 1),
        read_bytes_per_s=round(delta(s1, s0, SENT) / span, 1),
        put_bytes_per_s=round(delta(s1, s0, PUT_BYTES) / span, 1),
        state_bytes=round(delta(s1, s0, PUT_BYTES) / puts, 1) if puts else 0.0,
        lease_renewals_per_s=round(delta(s1, s0, LEASE_RENEWED) / span, 2),
        set_state_calls_per_s=round((c1[0] - c0[0]) / span, 2),
        cas_retries_per_s=round((c1[1] - c0[1]) / span, 2),
        db_bytes=s1.get(DB_BYTES, 0.0),
        db_in_use_bytes=s1.get(DB_IN_USE, 0.0),
        db_bytes_series=db_series,
        steady_rounds=extra_rounds,
        steady_s=round(span, 1),
        keep_alive_interval=keep_alive_interval,
        monitor_interval=monitor_interval,
        etcd_flags=" ".join(etcd_flags) or "(none: no compaction, default quota)",
    )


# (figure, header, width, decimals) of the human table.
COLUMNS = [("agents", "agents", 6, 0), ("round_s", "round s", 8, 2), ("reround_s", "reround s", 9, 2),
           ("detect_s", "detect s", 8, 2), ("requests_per_round", "req/round", 9, 0),
           ("heartbeat_writes_per_s", "writes/s", 8, 1), ("heartbeat_bytes_per_s", "recv B/s", 11, 0),
           ("read_bytes_per_s", "sent B/s", 11, 0), ("state_bytes", "state B", 8, 0),
           ("cas_retries_per_s", "CAS fail/s", 10, 1), ("db_bytes", "db bytes", 11, 0)]


def main() -> None:
    # A SIGTERM (timeout, kill) ends the run through the finally blocks: no etcd left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", default="32,128,512", help="agent counts, comma-separated (2 to 512)")
    parser.add_argument("--steady-s", type=float, default=20.0,
                        help="steady-state window per count, seconds (1800: the issue's 30-minute db bound)")
    parser.add_argument("--compaction", default="none",
                        help="none, infra (infra/aws/etcd.yaml's flags), periodic:RETENTION or revision:RETENTION")
    parser.add_argument("--keep-alive-interval", type=int, default=2, help="seconds (the rendezvous option)")
    parser.add_argument("--monitor-interval", type=float, default=0.1, help="seconds (torchrun's --monitor-interval)")
    parser.add_argument("--round-timeout", type=float, default=300.0,
                        help="seconds a round may take before the count is reported as not formed")
    parser.add_argument("--no-loss", action="store_true", help="skip the re-round after a loss")
    parser.add_argument("--json", action="store_true", help="one JSON object per agent count")
    args = parser.parse_args()
    try:
        sizes = [int(s) for s in args.agents.split(",") if s]
        flags = compaction_flags(args.compaction)
    except ValueError as exc:
        parser.error(str(exc) if "compaction" in str(exc) else f"--agents {args.agents!r}: give counts like 32,128,512")
    if not sizes or any(not 2 <= s <= MAX_AGENTS for s in sizes):
        parser.error(f"--agents {args.agents!r}: each count from 2 to {MAX_AGENTS}")
    if not 1 <= args.keep_alive_interval <= 60 or not 0.01 <= args.monitor_interval <= 10:
        parser.error("--keep-alive-interval: 1 to 60 s; --monitor-interval: 0.01 to 10 s")
    if not 1 <= args.steady_s <= 4 * 3600:
        parser.error("--steady-s: 1 to 14400 s")
    logging.basicConfig(level=logging.ERROR)  # the handlers log every state change at INFO
    # The doctor's start-up checks (hostname, interfaces, versions) per handler are not the control plane.
    os.environ.setdefault("ELASTIC_FT_DOCTOR_AT_START", "0")
    if not args.json:
        print(f"etcd3 rendezvous control plane: N agents (threads, one interpreter lock) on one etcd; "
              f"{os.cpu_count()} CPUs; steady state {args.steady_s:g} s; etcd flags: {' '.join(flags) or 'none'}")
        print(" ".join(f"{header:>{width}}" for _, header, width, _ in COLUMNS), flush=True)
    for n in sizes:
        with etcd_member(flags) as server:
            try:
                row = asdict(measure(server.endpoint, n, steady_s=args.steady_s,
                                     keep_alive_interval=args.keep_alive_interval,
                                     monitor_interval=args.monitor_interval, lose=not args.no_loss,
                                     etcd_flags=flags, round_timeout=args.round_timeout))
            except RoundNotFormed as exc:
                # A figure too: at this count the rounds do not form in time (the other figures need one).
                row = {**{name: None for name in Figures.__dataclass_fields__}, "agents": n,
                       "not_formed": str(exc), "joined": exc.joined}
        if args.json:
            print(json.dumps(row), flush=True)
        elif row.get("not_formed"):
            print(f"{n:>6}  {row['not_formed']}", flush=True)
        else:
            print(" ".join(f"{row[name]:>{width}.{places}f}" for name, _, width, places in COLUMNS), flush=True)


if __name__ == "__main__":
    main()
