"""The IMDSv2 client against a real HTTP server on 127.0.0.1 (tests/spot/imds_server.py)."""

from __future__ import annotations

import socket

import pytest

from elastic_ft.spot.imds import (
    ENDPOINT_ENV, EndpointError, ImdsClient, ImdsError, ImdsUnavailable, InstanceAction, endpoint_from_env,
    parse_instance_action, parse_rebalance, parse_time,
)
from tests.ports import free_port

WHEN = "2026-12-01T04:10:00Z"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_no_notice_is_404_and_reads_as_none(imds):
    client = ImdsClient(imds.url)
    assert client.instance_action() is None
    assert client.rebalance() is None


def test_notices_are_read_with_their_times(imds):
    client = ImdsClient(imds.url)
    imds.set_instance_action({"action": "stop", "time": WHEN})
    imds.set_rebalance({"noticeTime": WHEN})
    assert client.instance_action() == InstanceAction("stop", parse_time(WHEN))
    reb = client.rebalance()
    assert reb is not None and reb.notice_time == parse_time(WHEN) and reb.problem is None
    imds.set_instance_action(None)  # switched off again at runtime
    assert client.instance_action() is None


def test_token_is_cached_and_renewed_before_its_ttl_ends(imds):
    clock = Clock()
    client = ImdsClient(imds.url, token_ttl_s=100, clock=clock)
    client.instance_action()
    client.rebalance()
    assert imds.counts()[0] == 1, "a live token was fetched again"
    clock.t += 89  # 11 s left: more than the tenth of the TTL kept in hand
    client.instance_action()
    assert imds.counts()[0] == 1
    clock.t += 2  # 9 s left: renewed before the service would refuse it
    client.instance_action()
    assert imds.counts()[0] == 2 and imds.unauthorized == 0


def test_a_token_the_service_forgot_is_replaced_once(imds):
    client = ImdsClient(imds.url)
    imds.set_instance_action({"action": "terminate", "time": WHEN})
    assert client.instance_action() is not None
    imds.expire_tokens()
    assert client.instance_action() == InstanceAction("terminate", parse_time(WHEN))
    assert imds.unauthorized == 1 and imds.counts()[0] == 2


def test_no_server_is_unavailable():
    client = ImdsClient(f"http://127.0.0.1:{free_port()}", timeout_s=0.5)
    with pytest.raises(ImdsUnavailable, match="no answer from IMDS"):
        client.instance_action()


def test_a_server_that_never_answers_times_out():
    with socket.socket() as listener:  # accepts connections (backlog) but never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        client = ImdsClient(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=0.2)
        with pytest.raises(ImdsUnavailable, match="within 0.2 s"):
            client.rebalance()


def test_an_unexpected_status_is_an_error(imds):
    client = ImdsClient(imds.url)
    imds.fail_status = 500
    with pytest.raises(ImdsError, match="answered 500 to a token request"):
        client.instance_action()
    imds.fail_status = None
    client.instance_action()
    imds.fail_status = 503
    with pytest.raises(ImdsError, match="answered 503 to GET /latest/meta-data/spot/instance-action"):
        client.instance_action()


def test_a_malformed_instance_action_served_is_a_terminate_of_unknown_time(imds):
    client = ImdsClient(imds.url)
    imds.set_instance_action("<html>oops")
    action = client.instance_action()
    assert action is not None and (action.action, action.time) == ("terminate", None)
    assert "not JSON" in action.problem


@pytest.mark.parametrize("body, action, problem", [
    ('["terminate"]', "terminate", "not a JSON object"),
    ('{"action": "stop", "time": "yesterday"}', "stop", "bad time"),
    ('{"action": "stop", "time": "2026-12-01T04:10:00"}', "stop", "no time zone"),
    ('{"action": "stop"}', "stop", "time must be a string"),
    ('{"action": "reboot", "time": "2026-12-01T04:10:00Z"}', "terminate", "unknown action 'reboot'"),
])
def test_instance_action_documents_that_cannot_be_read_as_written(body, action, problem):
    got = parse_instance_action(body)
    assert got.action == action and problem in got.problem
    assert got.time is None or got.time == parse_time(WHEN)


@pytest.mark.parametrize("body", ["{}", "nope", '{"noticeTime": 5}', "[]"])
def test_a_malformed_rebalance_is_still_a_recommendation(body):
    got = parse_rebalance(body)
    assert got.notice_time is None and "unreadable rebalance recommendation" in got.problem and got.raw == body


@pytest.mark.parametrize("value, normalised", [
    ("", "http://169.254.169.254"),
    ("http://127.0.0.1:8080/", "http://127.0.0.1:8080"),
    ("https://imds.example", "https://imds.example"),
    ("http://[fd00:ec2::254]", "http://[fd00:ec2::254]"),
])
def test_endpoint_from_the_environment(value, normalised):
    assert endpoint_from_env({ENDPOINT_ENV: value} if value else {}) == normalised


@pytest.mark.parametrize("value, why", [
    ("169.254.169.254", "scheme must be http or https"),
    ("ftp://host", "scheme must be http or https"),
    ("http://host:99999", "Port out of range"),
    ("http://host:abc", "Port could not be cast"),
    ("http://", "needs a host"),
    ("http://user@host", "needs a host and no user name"),
    ("http://host/latest", "no path, query or fragment"),
])
def test_a_bad_endpoint_is_one_line_naming_the_variable(value, why):
    with pytest.raises(EndpointError) as info:
        endpoint_from_env({ENDPOINT_ENV: value})
    message = str(info.value)
    assert message.startswith(f"{ENDPOINT_ENV}={value!r} must look like http://host[:port]") and why in message
    assert "\n" not in message
