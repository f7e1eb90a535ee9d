"""The etcd control plane at 128 agents (threads, each a real etcd3 handler of ours, one real etcd).

The figures come from bench/control_plane.py's own ``measure`` (imported, not copied): 128 agents
form one round (world size 128, ranks 0..127), one of them dies (keep-alives stopped, connection
dropped) and the other 127 re-form a round without it; the keep-alive traffic etcd receives in a
steady state is measured at 32 and at 128 agents, each on a fresh etcd member.
"""

from __future__ import annotations

import math

import pytest

from bench.control_plane import Figures, RoundNotFormed, etcd_member, measure

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

STEADY_S = 8.0
# Linear growth from 32 to 128 agents is 4x the bytes per second; the slack covers the state's own
# growth with the membership (a round's record of 128 nodes is bigger than one of 32) and the noise of
# 8-second windows on a loaded machine. Quadratic growth (the whole state rewritten by every
# keep-alive) is 16x.
SLACK = 1.5


# How long a round of 128 may take here before the count is judged not to form (a 2-core machine
# shared with other jobs; 32 agents form theirs in about 2 s).
ROUND_TIMEOUT_S = 45.0


@pytest.fixture(scope="module")
def figures() -> dict[int, Figures | RoundNotFormed]:
    """The bench's figures at 32 and 128 agents; a count whose round did not form in time holds the error,
    so that each test below fails (or is an expected failure) on its own rather than in set-up."""
    out: dict[int, Figures | RoundNotFormed] = {}
    for n, lose in ((32, False), (128, True)):
        with etcd_member() as server:
            try:
                out[n] = measure(server.endpoint, n, steady_s=STEADY_S, lose=lose, round_timeout=ROUND_TIMEOUT_S)
            except RoundNotFormed as exc:
                out[n] = exc
    return out


def formed(figures: dict[int, Figures | RoundNotFormed], n: int) -> Figures:
    f = figures[n]
    if isinstance(f, RoundNotFormed):
        pytest.fail(str(f))
    return f


@pytest.mark.xfail(strict=False, reason=(
    "issue 27: with today's design every keep-alive, also while waiting in a round, is a compare-and-set of "
    "the whole state; on this loaded 2-core machine the in-process agents lose the race so often that "
    "participants go stale as fast as others join (64 agents stall at about 33 participants, 128 form no "
    "round in minutes). Not strict: on an idle machine 128 may form today. Remove with the leases redesign."))
def test_128_agents_form_a_round_and_re_form_it_without_a_lost_one(figures):
    # measure() checked both rounds: every agent joined, world sizes 128 then 127, ranks 0..N-1.
    f = formed(figures, 128)
    assert f.round_s > 0 and f.requests_per_round >= 128  # each agent wrote the state at least once
    assert math.isfinite(f.reround_s) and 0 < f.detect_s < f.reround_s
    # A dead node is seen once its keep-alive is older than interval x attempts (2 s x 3).
    assert f.detect_s >= f.keep_alive_interval * 3 * 0.9
    assert f.heartbeat_writes_per_s > 0 and f.db_bytes > 0


@pytest.mark.xfail(strict=True, reason=(
    "issue 27: every keep-alive rewrites the whole rendezvous state (all participants), so the bytes etcd "
    "receives per second grow with the square of the agents; the leases redesign removes this mark"))
def test_keep_alive_bytes_per_second_grow_at_most_linearly(figures):
    small, large = formed(figures, 32), formed(figures, 128)
    ratio = large.heartbeat_bytes_per_s / small.heartbeat_bytes_per_s
    assert ratio <= (128 / 32) * SLACK, (
        f"keep-alive bytes/s: {small.heartbeat_bytes_per_s:.0f} at 32 agents, {large.heartbeat_bytes_per_s:.0f} "
        f"at 128 ({ratio:.1f}x for 4x the agents)")
