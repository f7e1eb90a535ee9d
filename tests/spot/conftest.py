"""Fixtures of the spot tests: a local IMDS per test."""

from __future__ import annotations

import pytest

from tests.spot.imds_server import FakeImds


@pytest.fixture
def imds():
    server = FakeImds().start()
    try:
        yield server
    finally:
        server.stop()
