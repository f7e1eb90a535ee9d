"""The retry rules a node's request carries, evaluated as AWS Batch documents EvaluateOnExit.

AWS: up to 5 rules; a rule matches when every condition it gives matches; a
pattern is exact or ends with ``*`` (a prefix); the first matching rule's
action applies; none matching retries (while attempts remain).
"""

from __future__ import annotations

import pytest

from elastic_ft.aws_batch.retry import MAX_RULES, Action, decide, pattern_matches, retry_strategy
from elastic_ft.handoff.leave_marker import RECLAIM_EXIT_CODE
from tests.aws_batch.conftest import dryrun, train_args

SPOT_RECLAIM = "Host EC2 (instance i-0123456789abcdef0) terminated."


@pytest.fixture(scope="module")
def strategy() -> dict:
    """The retryStrategy that submit_job actually sends."""
    return dryrun(train_args()).request.submit_job["retryStrategy"]


@pytest.mark.parametrize(
    "exit_code, status_reason, reason, action",
    [
        # A Spot reclaim: the host went away, no exit code.
        (None, SPOT_RECLAIM, None, "RETRY"),
        # A node that committed and left on a spot notice.
        (RECLAIM_EXIT_CODE, "Essential container in task exited", None, "RETRY"),
        # A real error.
        (1, "Essential container in task exited", None, "EXIT"),
        (1, "Essential container in task exited", "Essential container in task exited", "EXIT"),
        (137, "Essential container in task exited", "OutOfMemoryError: Container killed due to memory usage", "EXIT"),
        # Success.
        (0, "Essential container in task exited", None, "EXIT"),
    ],
)
def test_request_rules_retry_reclaims_and_leaves_only(strategy, exit_code, status_reason, reason, action):
    got = decide(strategy["evaluateOnExit"], exit_code=exit_code, status_reason=status_reason, reason=reason)
    assert got == action


def test_at_most_five_rules_and_ten_attempts(strategy):
    assert 1 <= len(strategy["evaluateOnExit"]) <= MAX_RULES == 5
    assert strategy["attempts"] == 10
    assert {"onExitCode": str(RECLAIM_EXIT_CODE), "action": "RETRY"} in strategy["evaluateOnExit"]


def test_no_attempt_left_ends_a_reclaimed_node(strategy):
    rules = strategy["evaluateOnExit"]
    assert decide(rules, exit_code=None, status_reason=SPOT_RECLAIM, reason=None, attempt=9, attempts=10) == "RETRY"
    assert decide(rules, exit_code=None, status_reason=SPOT_RECLAIM, reason=None, attempt=10, attempts=10) == "EXIT"


@pytest.mark.parametrize("attempts", [0, 11, -1, True, "3"])
def test_attempts_outside_1_to_10_are_refused(attempts):
    with pytest.raises(ValueError, match=r"-cfg attempts=.*1 to 10"):
        retry_strategy(attempts)


@pytest.mark.parametrize(
    "pattern, value, matches",
    [
        ("75", "75", True),
        ("75", "750", False),
        ("7*", "75", True),
        ("Host EC2*", SPOT_RECLAIM, True),
        ("Host EC2*", "host ec2 (instance i-1) terminated.", False),
        ("Host EC2", SPOT_RECLAIM, False),
        ("*", None, True),
        ("*", "anything", True),
        ("0", None, False),
    ],
)
def test_patterns_are_exact_or_a_prefix_with_a_trailing_star(pattern, value, matches):
    assert pattern_matches(pattern, value) is matches


def test_every_condition_of_a_rule_must_match_and_the_first_match_wins():
    rules = [
        {"onExitCode": "1", "onStatusReason": "Task failed*", "action": "retry"},  # AWS: any case
        {"onExitCode": "1", "action": "EXIT"},
        {"onReason": "CannotPull*", "action": "RETRY"},
    ]
    assert decide(rules, exit_code=1, status_reason="Task failed to start", reason=None) is Action.RETRY
    assert decide(rules, exit_code=1, status_reason="Essential container in task exited", reason=None) is Action.EXIT
    assert decide(rules, exit_code=2, status_reason=None, reason="CannotPullContainerError: x") is Action.RETRY


def test_no_matching_rule_retries_a_failure_and_ends_a_success():
    assert decide([{"onExitCode": "3", "action": "EXIT"}], exit_code=1, status_reason=None, reason=None) == "RETRY"
    assert decide([], exit_code=0, status_reason=None, reason=None) == "EXIT"
    assert decide([{"action": "EXIT"}], exit_code=1, status_reason=None, reason=None) == "RETRY"
