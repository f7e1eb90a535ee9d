"""The retry strategy of an elastic_ft node on AWS Batch, and how AWS applies it.

A node (one array child) is resubmitted when Spot reclaimed its host before it
could leave (the status reason starts with ``Host EC2``) or when it left on a
spot notice after the job committed its state (exit 75,
:data:`elastic_ft.handoff.leave_marker.RECLAIM_EXIT_CODE`); it ends on success (0) and
on anything else. :func:`decide` evaluates such rules as AWS documents
(API_EvaluateOnExit, "Automated job retries"), so tests can check the rules a
request carries against the status AWS reports.
"""

from __future__ import annotations

import enum
from typing import Dict, List, Mapping, Optional, Sequence

from elastic_ft.handoff.leave_marker import RECLAIM_EXIT_CODE

DEFAULT_ATTEMPTS = 10
MAX_ATTEMPTS = 10  # AWS Batch allows 1 to 10 attempts
MAX_RULES = 5  # and at most 5 evaluateOnExit entries

SPOT_RECLAIM_STATUS = "Host EC2*"
"""A reclaimed Spot host's status reason: ``Host EC2 (instance i-...) terminated.``"""


class Action(str, enum.Enum):
    """What AWS Batch does with a finished attempt; equal to the API's strings."""

    RETRY = "RETRY"
    EXIT = "EXIT"

    def __str__(self) -> str:
        return self.value


def evaluate_on_exit() -> List[Dict[str, str]]:
    """The rules, first match wins: retry a reclaim and a node that left (75); exit on 0 and on the rest.

    The catch-all matches ``onReason`` because an ``onExitCode`` pattern may
    hold only digits (and a trailing ``*``), and a reclaimed host reports no
    exit code at all.
    """
    return [
        {"onStatusReason": SPOT_RECLAIM_STATUS, "action": Action.RETRY.value},
        {"onExitCode": str(RECLAIM_EXIT_CODE), "action": Action.RETRY.value},
        {"onExitCode": "0", "action": Action.EXIT.value},
        {"onReason": "*", "action": Action.EXIT.value},
    ]


def attempts_problem(attempts: object) -> Optional[str]:
    """Why ``attempts`` is not a run count AWS accepts (1 to 10), naming the run option; None if it is."""
    if isinstance(attempts, bool) or not isinstance(attempts, int) or not 1 <= attempts <= MAX_ATTEMPTS:
        return (
            f"-cfg attempts={attempts}: AWS Batch allows 1 to {MAX_ATTEMPTS} attempts per node; "
            f"give a whole number in that range (default {DEFAULT_ATTEMPTS})"
        )
    return None


def retry_strategy(attempts: int = DEFAULT_ATTEMPTS) -> Dict[str, object]:
    """The ``retryStrategy`` of a node: ``attempts`` runs at most (1 to 10), :func:`evaluate_on_exit`'s rules.

    Raises:
        ValueError: :func:`attempts_problem`'s message.
    """
    problem = attempts_problem(attempts)
    if problem:
        raise ValueError(problem)
    rules = evaluate_on_exit()
    assert len(rules) <= MAX_RULES
    return {"attempts": attempts, "evaluateOnExit": rules}


def pattern_matches(pattern: str, value: Optional[str]) -> bool:
    """AWS's glob: ``value`` equals ``pattern``, or starts with it less a trailing ``*``.

    A missing value (no exit code after a host loss, no reason) reads as the
    empty string, which only a pattern of ``*`` alone matches.
    """
    text = "" if value is None else value
    if pattern.endswith("*"):
        return text.startswith(pattern[:-1])
    return text == pattern


def rule_matches(
    rule: Mapping[str, str], *, exit_code: Optional[int], status_reason: Optional[str], reason: Optional[str]
) -> bool:
    """Whether every condition the rule gives matches (a rule with none matches nothing)."""
    given = {
        "onExitCode": None if exit_code is None else str(exit_code),
        "onStatusReason": status_reason,
        "onReason": reason,
    }
    conditions = [(key, rule[key]) for key in given if key in rule]
    return bool(conditions) and all(pattern_matches(p, given[key]) for key, p in conditions)


def decide(
    rules: Sequence[Mapping[str, str]],
    *,
    exit_code: Optional[int],
    status_reason: Optional[str],
    reason: Optional[str],
    attempt: int = 1,
    attempts: int = MAX_ATTEMPTS,
) -> Action:
    """The action of the first rule that matches; RETRY when none does (as AWS does).

    ``attempt`` is the number of the attempt that just ended (AWS_BATCH_JOB_ATTEMPT,
    from 1); a RETRY with no attempt left (``attempt >= attempts``) is an EXIT.
    A successful attempt (exit 0) that no rule names ends the job: AWS retries
    failed attempts only.
    """
    action = Action.RETRY
    for rule in rules:
        if rule_matches(rule, exit_code=exit_code, status_reason=status_reason, reason=reason):
            action = Action(rule["action"].upper())  # AWS reads actions case-insensitively
            break
    else:
        if exit_code == 0:
            return Action.EXIT
    if action is Action.RETRY and attempt >= attempts:
        return Action.EXIT
    return action
