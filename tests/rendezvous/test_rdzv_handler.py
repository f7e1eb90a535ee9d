"""Tests of the etcd3 handler factory: options, entry point, in-process rendezvous,
the protobuf runtime, and TLS + auth against a real etcd.
"""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from importlib.metadata import entry_points

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

import elastic_ft.rendezvous
from elastic_ft.rendezvous.entry import etcd3_handler
from elastic_ft.rendezvous.handler import create_handler
from elastic_ft.rendezvous.options import parse_options
from elastic_ft.rendezvous.state_codec import KEY_ENV

from etcd_server import ROOT_PASSWORD, EtcdServer
from threads import run_in_threads


def params(endpoint: str, run_id: str, min_nodes: int = 1, max_nodes: int = 1, **conf) -> RendezvousParameters:
    return RendezvousParameters("etcd3", endpoint, run_id, min_nodes, max_nodes, **conf)


# -- options ---------------------------------------------------------------------


def test_options_defaults_and_endpoints():
    options = parse_options("h1:2379,h2", {"endpoints": "h3:1234;h1:2379", "timeout": 900})
    assert [str(e) for e in options.connection.endpoints] == ["h1:2379", "h2:2379", "h3:1234"]
    assert options.key_prefix == "/elastic_ft/rendezvous"
    assert options.connection.lease_ttl == 7200
    assert options.run_prefix("r") == "/elastic_ft/rendezvous/r/"
    # Fast recovery out of the box: a lost member counts after 6 s, a round completes 3 s after enough nodes.
    assert (options.keep_alive_interval, options.keep_alive_max_attempt) == (2, 3)
    assert options.last_call_timeout == timedelta(seconds=3)
    assert options.join_timeout is None  # torch's 600 s


def test_options_validation_names_every_bad_option(tmp_path):
    with pytest.raises(ValueError) as info:
        parse_options(
            "host:notaport",
            {
                "lease_ttl": "0",
                "request_timeout": "soon",
                "join_timeout": "-5",
                "ca_cert": str(tmp_path / "missing.pem"),
                "user": "root",
                "key_prefix": "relative",
                "lease_tll": "10",
                "retry_timeout": "inf",
                "keep_alive_interval": "9" * 30,
                "close_timeout": "nan",
            },
        )
    message = str(info.value)
    for fragment in (
        "rdzv_endpoint: the port of endpoint 'host:notaport'",
        "lease_ttl: '0' must be greater than 0",
        "request_timeout: 'soon' is not a valid float",
        "join_timeout: '-5' must be greater than 0",
        "ca_cert: the file",
        "user/password: give both",
        "key_prefix: 'relative'",
        "lease_tll: unknown option",
        "retry_timeout: 'inf' must be a finite number",
        "keep_alive_interval: '999999999999999999999999999999' must be a finite number at most",
        "close_timeout: 'nan' is not a valid int",
    ):
        assert fragment in message


def test_options_accept_torch_v2_names_and_password_env(tls_files):
    options = parse_options(
        "127.0.0.1:1",
        {
            "ca_cert": tls_files.ca_cert,
            "ssl_cert": tls_files.client_cert,
            "ssl_cert_key": tls_files.client_key,
            "user": "root",
            "password_env": "ETCD_TEST_PASSWORD",
        },
        environ={"ETCD_TEST_PASSWORD": "pw"},
    )
    assert options.connection.client_cert == tls_files.client_cert
    assert options.connection.password == "pw"
    assert "pw" not in repr(options)


def test_credentials_without_tls_are_refused_naming_ca_cert_and_insecure_auth():
    credentials = {"user": "root", "password_env": "ETCD_TEST_PASSWORD"}
    with pytest.raises(ValueError) as info:
        parse_options("127.0.0.1:1", credentials, environ={"ETCD_TEST_PASSWORD": "pw"})
    message = str(info.value)
    assert "user/password: etcd credentials without TLS" in message
    assert "give ca_cert" in message and "insecure_auth=true" in message
    assert "pw" not in message


def test_insecure_auth_accepts_credentials_without_tls_and_must_be_a_boolean():
    conf = {"user": "root", "password_env": "ETCD_TEST_PASSWORD"}
    environ = {"ETCD_TEST_PASSWORD": "pw"}
    options = parse_options("127.0.0.1:1", {**conf, "insecure_auth": "True"}, environ)
    assert (options.connection.user, options.connection.ca_cert) == ("root", None)
    with pytest.raises(ValueError, match="insecure_auth: 'maybe' is not a boolean; use true or false"):
        parse_options("127.0.0.1:1", {**conf, "insecure_auth": "maybe"}, environ)
    with pytest.raises(ValueError, match="insecure_auth=true"):
        parse_options("127.0.0.1:1", {**conf, "insecure_auth": "false"}, environ)


@pytest.mark.parametrize("conf", [
    {"user": "root", "password": "s3cret-value", "ca_cert": __file__},
    {"user": "root", "password": "s3cret-value", "password_env": "ETCD_TEST_PASSWORD", "ca_cert": __file__},
    {"password": "s3cret-value"},
])
def test_password_in_rdzv_conf_is_refused_naming_password_env(conf):
    """--rdzv-conf is on torchrun's command line (ps): plain torchrun refuses it as the component does."""
    with pytest.raises(ValueError) as info:
        parse_options("127.0.0.1:1", conf, environ={"ETCD_TEST_PASSWORD": "pw"})
    lines = [line for line in str(info.value).splitlines() if line.strip().startswith("- password:")]
    assert len(lines) == 1 and "give password_env=VAR instead" in lines[0] and "(ps)" in lines[0]
    assert "s3cret-value" not in str(info.value)


def test_options_name_the_secrets_read_from_the_environment(tls_files):
    conf = {"ca_cert": tls_files.ca_cert, "user": "root", "password_env": "ETCD_TEST_PASSWORD"}
    key = "k" * 32
    options = parse_options("127.0.0.1:1", conf, environ={"ETCD_TEST_PASSWORD": "pw", KEY_ENV: key})
    # The state key wins over the password; both variables are the agent's to hide from its workers.
    assert (options.state_secret.value, options.state_secret.source) == (key, KEY_ENV)
    assert set(options.secret_env) == {"ETCD_TEST_PASSWORD", KEY_ENV}
    options = parse_options("127.0.0.1:1", conf, environ={"ETCD_TEST_PASSWORD": "pw"})
    assert (options.state_secret.value, options.state_secret.source) == ("pw", "the etcd password")
    assert options.secret_env == ("ETCD_TEST_PASSWORD",)
    assert parse_options("127.0.0.1:1", {}, environ={}).state_secret is None
    assert key not in repr(parse_options("127.0.0.1:1", {}, environ={KEY_ENV: key}))


def test_a_short_state_key_is_refused_naming_the_variable_not_the_value():
    with pytest.raises(ValueError) as info:
        parse_options("127.0.0.1:1", {}, environ={KEY_ENV: "short-key"})
    message = str(info.value)
    assert f"{KEY_ENV}: the rendezvous key must have 16 to 4096 characters (it has 9)" in message
    assert "short-key" not in message


def test_no_endpoint_is_an_error():
    with pytest.raises(ValueError, match="no etcd endpoint given"):
        parse_options("", {})


# -- entry point and handler -----------------------------------------------------------


def test_entry_point_is_registered_for_torchrun():
    found = [ep for ep in entry_points(group="torchrun.handlers") if ep.name == "etcd3"]
    assert len(found) == 1
    assert found[0].load() is etcd3_handler
    assert callable(etcd3_handler())


FIRST_IMPORT = "test_etcd3_is_registered_whichever_of_our_modules_imports_torchs_rendezvous_first"


@pytest.fixture(scope="module")
def first_imports(request):
    """A fresh interpreter per module that imports it first, three at a time, all started with the first
    case: each is mostly torch's import, so the cases' interpreters overlap instead of queueing."""

    def first_import(module: str) -> subprocess.CompletedProcess:
        code = (f"import elastic_ft.rendezvous.{module}\n"
                "from torch.distributed.elastic.rendezvous import registry\n"
                "print('etcd3' in registry.handler_registry._registry)")
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)

    selected = [item.callspec.params["module"] for item in request.session.items
                if getattr(item, "originalname", None) == FIRST_IMPORT]
    with ThreadPoolExecutor(max_workers=3) as pool:
        yield {module: pool.submit(first_import, module) for module in selected}


@pytest.mark.parametrize("module", sorted(
    m.name for m in pkgutil.iter_modules(elastic_ft.rendezvous.__path__) if m.name != "entry"))
@pytest.mark.subprocess
def test_etcd3_is_registered_whichever_of_our_modules_imports_torchs_rendezvous_first(module, first_imports):
    # torch loads the entry points while its rendezvous package initialises; an entry point that imported
    # our modules found the one being imported half-initialised, and torch dropped etcd3 with a warning.
    proc = first_imports[module].result()
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stdout + proc.stderr


def test_torch_registry_builds_our_handler(etcd, run_id):
    handler = get_rendezvous_handler(params(etcd.endpoint, run_id, join_timeout="42"))
    assert handler.get_backend() == "etcd3"
    assert handler.get_run_id() == run_id
    assert handler.use_agent_store is False


def test_torch_standard_options_reach_the_dynamic_handler(etcd, run_id):
    handler = create_handler(
        params(
            etcd.endpoint,
            run_id,
            join_timeout="42",
            last_call_timeout="3",
            close_timeout="7",
            keep_alive_interval="2",
            keep_alive_max_attempt="4",
        )
    )
    settings = handler.settings
    assert settings.timeout.join == timedelta(seconds=42)
    assert settings.timeout.last_call == timedelta(seconds=3)
    assert settings.timeout.close == timedelta(seconds=7)
    assert settings.keep_alive_interval == timedelta(seconds=2)
    assert settings.keep_alive_max_attempt == 4


def test_handlers_in_threads_form_one_world(etcd, run_id):
    n = 4
    handlers = [
        create_handler(params(etcd.endpoint, run_id, n, n, last_call_timeout="1", join_timeout="60"))
        for _ in range(n)
    ]
    infos = run_in_threads(lambda i: handlers[i].next_rendezvous(), n)
    assert sorted(info.rank for info in infos) == list(range(n))
    assert {info.world_size for info in infos} == {n}
    # Every node learned the same MASTER_ADDR/PORT through the etcd store.
    assert len({(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}) == 1
    for h in handlers:
        h.shutdown()


# -- protobuf runtime ---------------------------------------------------------------------


def test_etcd_client_works_after_protobuf_was_imported_with_its_default_runtime(etcd: EtcdServer):
    """The client must not need a protobuf runtime chosen process-wide (python-etcd3
    0.12 needed the pure-Python one, set before protobuf's first import)."""
    env = {k: v for k, v in os.environ.items() if k != "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"}
    code = (
        "import os\n"
        "import google.protobuf.message\n"
        "from google.protobuf.internal import api_implementation\n"
        "runtime = api_implementation.Type()\n"
        "from elastic_ft.rendezvous.etcd import EtcdClient\n"
        "from elastic_ft.rendezvous.options import parse_options\n"
        f"client = EtcdClient(parse_options({etcd.endpoint!r}, {{}}).connection, name='protobuf')\n"
        "client.put_many([('elastic_ft/test/protobuf', b'v')])\n"
        "value, _ = client.get('elastic_ft/test/protobuf')\n"
        "print(runtime, api_implementation.Type(), value.value.decode(), "
        "os.environ.get('PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION'))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    runtime, runtime_after, value, variable = result.stdout.split()
    assert runtime != "python"
    assert (runtime_after, value, variable) == (runtime, "v", "None")


# -- TLS and auth ----------------------------------------------------------------------


@pytest.fixture
def root_password(monkeypatch) -> str:  # type: ignore[no-untyped-def]
    """The name of a variable holding etcd's root password (the agent takes it out of its environment)."""
    monkeypatch.setenv("ETCD_TEST_PASSWORD", ROOT_PASSWORD)
    return "ETCD_TEST_PASSWORD"


def tls_conf(tls_files, **extra: str) -> dict[str, str]:
    conf = {
        "ca_cert": tls_files.ca_cert,
        "client_cert": tls_files.client_cert,
        "client_key": tls_files.client_key,
        "retry_timeout": "2",
    }
    conf.update(extra)
    return conf


def assert_reads_its_write(client, run_id: str) -> None:
    """The handler's own etcd client writes a key and reads it back (over TLS, or with auth)."""
    key = f"elastic_ft/test/{run_id}/k"
    client.put_many([(key, b"v")])
    assert client.get(key)[0].value == b"v"


def test_tls_and_auth_work_with_the_right_credentials(etcd_tls, tls_files, run_id, root_password):
    handler = create_handler(
        params(etcd_tls.endpoint, run_id, **tls_conf(tls_files, user="root", password_env=root_password))
    )
    backend = handler._state_holder._backend
    state, _, written = backend.set_state(b"secure")
    assert (state, written) == (b"secure", True)
    assert backend.get_state()[0] == b"secure"
    assert_reads_its_write(handler.etcd_client, run_id)


def test_tls_and_auth_fail_clearly_without_credentials(etcd_tls, tls_files, run_id):
    # The client certificate's common name is not an etcd user, so etcd has no
    # identity with rights on the prefix.
    handler = create_handler(params(etcd_tls.endpoint, run_id, **tls_conf(tls_files)))
    with pytest.raises(RendezvousConnectionError, match="permission denied.*user and password") as info:
        handler._state_holder._backend.get_state()
    assert etcd_tls.endpoint in str(info.value)


def test_tls_and_auth_fail_clearly_with_a_wrong_password(etcd_tls, tls_files, run_id, monkeypatch):
    # The handler connects when it is built, as torch's c10d one does: it fails there.
    monkeypatch.setenv("ETCD_TEST_WRONG_PASSWORD", "wrong")
    conf = tls_conf(tls_files, user="root", password_env="ETCD_TEST_WRONG_PASSWORD")
    with pytest.raises(RendezvousConnectionError, match="user and password"):
        create_handler(params(etcd_tls.endpoint, run_id, **conf))


def test_tls_server_without_tls_options_fails_naming_endpoint_and_tls(etcd_tls, run_id, root_password):
    conf = dict(user="root", password_env=root_password, insecure_auth="true", retry_timeout="1")
    with pytest.raises(RendezvousConnectionError, match="TLS options") as info:
        create_handler(params(etcd_tls.endpoint, run_id, **conf))
    assert etcd_tls.endpoint in str(info.value)


@pytest.fixture(scope="module")
def etcd_auth_plain(tmp_path_factory: pytest.TempPathFactory) -> EtcdServer:
    """An etcd with auth on and no TLS: the password would travel in clear text."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd-auth-plain") / "data").start()
    try:
        server.enable_auth(ROOT_PASSWORD)
        yield server
    finally:
        server.stop()


@pytest.mark.etcd  # its own etcd with auth (etcd_auth_plain)
def test_auth_without_tls_needs_insecure_auth_on_a_real_server(etcd_auth_plain, run_id, root_password):
    conf = dict(user="root", password_env=root_password)
    with pytest.raises(ValueError, match="without TLS .* give ca_cert .* insecure_auth=true"):
        create_handler(params(etcd_auth_plain.endpoint, run_id, **conf))
    handler = create_handler(params(etcd_auth_plain.endpoint, run_id, insecure_auth="true", **conf))
    try:
        assert_reads_its_write(handler.etcd_client, run_id)
    finally:
        handler.etcd_client.close()


def test_the_handler_takes_the_password_and_state_key_out_of_its_environment(
    etcd_tls, tls_files, run_id, root_password, monkeypatch
):
    """The workers torch starts copy the agent's os.environ; they never talk to etcd."""
    monkeypatch.setenv(KEY_ENV, "the job's key, at least 16 characters")
    monkeypatch.setenv("ETCD_TEST_CONTROL", "kept")
    handler = create_handler(params(etcd_tls.endpoint, run_id, **tls_conf(tls_files, user="root",
                                                                           password_env=root_password)))
    try:
        assert root_password not in os.environ and KEY_ENV not in os.environ
        assert os.environ["ETCD_TEST_CONTROL"] == "kept"
        backend = handler._state_holder._backend
        assert backend.codec.source == KEY_ENV
        assert backend.set_state(b"still works")[2] and backend.get_state()[0] == b"still works"
    finally:
        handler.etcd_client.close()


def test_an_agent_without_a_key_says_so_in_one_warning(etcd, run_id, caplog, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with caplog.at_level("INFO", logger="elastic_ft.rendezvous.handler"):
        handler = create_handler(params(etcd.endpoint, run_id))
    handler.etcd_client.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "authenticated" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert f"{run_id}/state is not authenticated (no {KEY_ENV} and no etcd password)" in warnings[0]
    assert "cannot run code here" in warnings[0]
