"""bench/trace_replay.py's pure parts: a trace read, folded onto the cluster's nodes, compressed, a segment chosen
(bench/trace_segments.py), and the costs a run's events show (bench/replay_costs.py)."""

from __future__ import annotations

import pytest

from bench import replay_costs as rc
from bench import trace_segments as tr
from bench.goodput_traces import TraceError


def changes(*rows: tuple[int, str, str]) -> list[tr.Change]:
    return [tr.Change(ms, a, n) for ms, a, n in rows]


def test_a_trace_is_read_in_time_order_header_and_blank_lines_skipped():
    text = "ms,action,node\n120,remove,node2\n\n0,add,node1\n0,add,node2\n"
    assert tr.parse_trace(text) == changes((0, "add", "node1"), (0, "add", "node2"), (120, "remove", "node2"))


@pytest.mark.parametrize("line, named", [
    ("5,add", "expected 'ms,add|remove,node'"),
    ("-5,add,node1", "is not a whole number of milliseconds"),
    ("5,reclaim,node1", "is not 'add' or 'remove'"),
    ("5,add,", "the node is empty"),
])
def test_a_bad_line_is_one_error_naming_the_file_and_line(line, named):
    with pytest.raises(TraceError) as e:
        tr.parse_trace(f"0,add,node1\n{line}\n", "p3.csv")
    assert str(e.value).startswith("p3.csv:2: ") and named in str(e.value) and "\n" not in str(e.value)


def test_folding_keeps_the_fleets_changes_and_merges_those_that_change_nothing():
    fleet = changes((0, "add", "node1"), (0, "add", "node2"), (0, "add", "node3"), (0, "add", "node4"),
                    (60, "remove", "node4"),   # node4 -> node0 (3 nodes): down
                    (60, "remove", "node1"),   # node1 -> node0 too: already down, merged
                    (120, "add", "node7"),     # node7 -> node0: up again
                    (120, "add", "node5"),     # node5 -> node1: already up, merged
                    (180, "remove", "node2"))  # node2 -> node1: down
    assert tr.fold(fleet, 3) == changes((0, "add", "node0"), (0, "add", "node1"), (0, "add", "node2"),
                                        (60, "remove", "node0"), (120, "add", "node0"), (180, "remove", "node1"))


def test_a_segment_starts_with_the_nodes_up_then_and_counts_time_from_its_start():
    fleet = changes((0, "add", "node1"), (0, "add", "node2"), (60, "remove", "node1"), (100, "remove", "node2"),
                    (200, "add", "node4"), (300, "remove", "node4"))
    assert tr.fold(fleet, 3, start_ms=80, end_ms=300) == changes((0, "add", "node1"), (20, "remove", "node1"),
                                                                 (120, "add", "node0"))


def test_compression_divides_every_time():
    assert tr.compress(changes((0, "add", "node0"), (60_000, "remove", "node0")), 6) == \
        changes((0, "add", "node0"), (10_000, "remove", "node0"))
    with pytest.raises(TraceError, match="--factor"):
        tr.compress([], 0)


def test_the_busiest_window_has_changes_after_the_lead_and_never_every_node_down():
    fleet = changes((0, "add", "node1"), (0, "add", "node2"), (0, "add", "node3"),
                    (30_000, "remove", "node1"), (90_000, "add", "node4"),  # within the lead of the early windows
                    (600_000, "remove", "node2"), (600_000, "remove", "node3"), (600_000, "remove", "node4"),
                    (630_000, "add", "node5"), (640_000, "add", "node6"),  # every node down 600-630 s
                    (800_000, "remove", "node5"), (860_000, "add", "node7"))
    start = tr.busiest_start(fleet, 3, 300_000, lead_ms=60_000)
    assert start == 660_000
    assert tr.fold(fleet, 3, start, start + 300_000) == changes(
        (0, "add", "node1"), (0, "add", "node2"), (140_000, "remove", "node1"), (200_000, "add", "node0"))


def test_no_window_is_one_clear_error():
    with pytest.raises(TraceError, match="--start-min"):
        tr.busiest_start(changes((0, "add", "node1")), 3, 60_000)


def test_the_synthetic_segment_plays_a_loss_a_return_and_the_loss_of_the_two_worker_node():
    seg = tr.fold(tr.parse_trace(tr.synthetic_segment()), 3)
    assert [c.node for c in seg[:3]] == ["node0", "node1", "node2"]
    assert [(c.action, c.node) for c in seg[3:]] == [("remove", "node2"), ("add", "node2"), ("remove", "node1")]
    assert max(c.ms for c in seg) < tr.SYNTHETIC_END_MS


def test_the_compression_leaves_room_for_the_start_and_for_a_restart_between_changes():
    seg = tr.fold(tr.parse_trace(tr.synthetic_segment()), 3)  # first change at 240 s, then every 120 s
    idle = {"first_start_s": 20.0, "step_s": 0.2, "kill_restart_s": 5.0, "load_s": 8.0, "join_boot_s": 5.0}
    assert tr.fitting_factor(seg, idle, 6.0) == 6.0  # the cap
    loaded = {**idle, "first_start_s": 70.0, "step_s": 4.0}  # 240 / (70 + 20 + 5) = 2.53; 120 / (18 + 12) = 4
    assert tr.fitting_factor(seg, loaded, 6.0) == pytest.approx(240 / 95)
    slow_restart = {**idle, "load_s": 40.0}  # 120 / (5 + 40 + 5 + 0.6)
    assert tr.fitting_factor(seg, slow_restart, 6.0) == pytest.approx(120 / 50.6)
    assert tr.fitting_factor(seg, {**idle, "first_start_s": 1000.0}, 6.0) == 1.0


def test_the_models_costs_split_the_first_start_and_boot_a_joining_node_as_measured():
    # the first agent at 100 s, its worker at 103 s, the worker's resume plan at 110 s (goodput: 3 s restart, 7 s
    # loading); a node started again at 200 s whose agent joined as the survivors ended step 20 at 206.5 s
    events = [{"event": "start", "ts": 103.5, "world": 1, "agent_start": 100.0, "process_start": 103.0},
              {"event": "resume_plan", "ts": 110.0}] + \
             [{"event": "step_done", "step": s, "ts": 110.0 + 5 * s / 16, "seconds": 0.3} for s in range(1, 21)] + \
             [{"event": "preempted", "ts": 207.0},
              {"event": "start", "ts": 212.5, "world": 2, "process_start": 212.0},
              {"event": "resume_plan", "ts": 219.0}]
    events[-4]["ts"] = 206.5
    measured = rc.costs_of(events, kills=[], joins=[200.0], full=2, every_steps=10)
    assert measured["first_restart_s"] == pytest.approx(3.0) and measured["first_load_s"] == pytest.approx(7.0)
    assert measured["join_boot_s"] == pytest.approx(6.5)
    fields = rc.model_costs(measured, 2)
    assert fields["initial_restart_s"] == pytest.approx(3.0) and fields["initial_load_s"] == pytest.approx(7.0)
    assert fields["join_boot_s"] == pytest.approx(6.5)
