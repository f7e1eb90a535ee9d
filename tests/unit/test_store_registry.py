"""The scheme registry: open_store finds a backend by the URI's scheme, imports it only when used."""

import subprocess
import sys
import urllib.parse

import pytest

from elastic_ft.checkpoint import store
from elastic_ft.checkpoint.errors import UnsupportedURI
from elastic_ft.checkpoint.local import LocalStore
from elastic_ft.checkpoint.store import check_uri, open_store, register_scheme


class TestFileStore(LocalStore):
    """A real store for a scheme only this test knows: ``testfile:///abs/dir``."""

    __test__ = False  # not a pytest class


def open_testfile(uri: str) -> TestFileStore:
    return TestFileStore(urllib.parse.urlparse(uri).path, uri=uri)


def refuse_query(uri: str) -> None:
    if urllib.parse.urlparse(uri).query:
        raise UnsupportedURI(f"testfile URI {uri!r} has a query")


@pytest.fixture
def schemes(monkeypatch):
    """The registry as the test leaves it is thrown away afterwards."""
    monkeypatch.setattr(store, "_SCHEMES", dict(store._SCHEMES))


@pytest.mark.parametrize("uri", ["gs://bucket/runs", "HTTP://host/runs", "mem://x"])
def test_unknown_scheme_names_it_and_the_known_ones(uri):
    scheme = uri.split(":")[0].lower()  # urlparse lowercases it
    for call in (check_uri, open_store):
        with pytest.raises(UnsupportedURI, match=f"unsupported scheme {scheme!r}; known schemes: file://, s3://$"):
            call(uri)


def test_a_registered_scheme_is_opened(schemes, tmp_path):
    register_scheme("testfile", f"{__name__}:open_testfile", checker=f"{__name__}:refuse_query")
    assert "testfile" in store.registered_schemes()
    s = open_store(f"testfile://{tmp_path}")
    assert type(s) is TestFileStore and s.root == str(tmp_path)
    s.put("a/b", b"xyz")
    assert (tmp_path / "a" / "b").read_bytes() == b"xyz"
    assert check_uri(f"TESTFILE://{tmp_path}") is None  # schemes are case-insensitive, as urlparse reads them
    with pytest.raises(UnsupportedURI, match="has a query"):
        open_store(f"testfile://{tmp_path}?x=1")


@pytest.mark.parametrize("scheme, opener", [("", "m:f"), ("3d", "m:f"), ("a b", "m:f"), ("ok", "no_colon")])
def test_register_refuses_a_bad_scheme_or_path(schemes, scheme, opener):
    with pytest.raises(ValueError, match="register_scheme: "):
        register_scheme(scheme, opener)


def test_file_and_s3_resolve_to_their_classes(tmp_path, monkeypatch):
    from elastic_ft.checkpoint.s3 import S3Store

    assert type(open_store(f"file://{tmp_path}")) is LocalStore
    assert type(open_store(str(tmp_path))) is LocalStore
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")  # a client is built, nothing is sent
    s3 = open_store("s3://bucket/runs")
    try:
        assert type(s3) is S3Store and (s3.bucket, s3.prefix) == ("bucket", "runs/")
    finally:
        s3.close()


@pytest.mark.subprocess
def test_store_imports_no_backend():
    # A fresh interpreter: this process has long imported boto3 for other tests.
    code = (
        "import sys, elastic_ft.checkpoint.store as s\n"
        "s.check_uri('/tmp/x')\n"
        "bad = [m for m in ('boto3', 'botocore', 'elastic_ft.checkpoint.s3', 'elastic_ft.checkpoint.local')"
        " if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.subprocess
@pytest.mark.parametrize("module", ["elastic_ft.checkpoint.s3", "elastic_ft.checkpoint.local"])
def test_each_backend_imports_first_without_a_cycle(module):
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
