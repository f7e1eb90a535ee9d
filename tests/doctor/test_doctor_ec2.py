"""The IMDS check: absent (closed port) is a pass; a local IMDSv2 answers with the instance type and notices."""

from __future__ import annotations

from elastic_ft.doctor import ec2
from elastic_ft.spot.imds import ENDPOINT_ENV
from tests.ports import free_port


def test_imds_absent_is_not_on_ec2():
    r = ec2.check_imds({ENDPOINT_ENV: f"http://127.0.0.1:{free_port()}"})
    assert r.status == "PASS" and r.found.startswith("not on EC2"), r.line()


def test_imds_answering_reports_the_instance_type(imds):
    imds.documents[ec2.INSTANCE_TYPE_PATH] = "g5.xlarge"
    r = ec2.check_imds({ENDPOINT_ENV: imds.url})
    assert (r.status, r.found) == ("PASS", f"on EC2 (g5.xlarge) via {imds.url}; no spot notice")


def test_pending_spot_notice_warns(imds):
    imds.set_instance_action({"action": "terminate", "time": "2026-12-01T04:10:00Z"})
    r = ec2.check_imds({ENDPOINT_ENV: imds.url})
    assert r.status == "WARN" and "terminate at 04:10:00 UTC" in r.found, r.line()


def test_imds_answering_errors_warns(imds):
    imds.fail_status = 500
    assert ec2.check_imds({ENDPOINT_ENV: imds.url}).status == "WARN"


def test_bad_endpoint_fails():
    assert ec2.check_imds({ENDPOINT_ENV: "ftp://x"}).status == "FAIL"
