"""The torchx component (elastic_ft.components): argument checks and the AppDef it builds."""

import os
import shlex

import pytest

from elastic_ft.components import train
from elastic_ft.submission.arguments import parse_nnodes


@pytest.mark.parametrize("text,expected", [("1", (1, 1)), ("4", (4, 4)), ("2:8", (2, 8)), (" 1:1 ", (1, 1))])
def test_parse_nnodes(text, expected):
    assert parse_nnodes(text) == expected


@pytest.mark.parametrize("text", ["", "a", "2:", ":3", "1:2:3", "-1", "2-4"])
def test_parse_nnodes_syntax_errors(text):
    with pytest.raises(ValueError, match="must be N or MIN:MAX"):
        parse_nnodes(text)


@pytest.mark.parametrize("text", ["0", "3:2", "0:4"])
def test_parse_nnodes_range_errors(text):
    with pytest.raises(ValueError, match="1 <= MIN <= MAX"):
        parse_nnodes(text)


def command(app) -> list[str]:
    (role,) = app.roles
    assert role.entrypoint == "bash" and role.args[0] == "-c"
    return shlex.split(role.args[1])


def flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_defaults():
    app = train()
    (role,) = app.roles
    assert role.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert (role.num_replicas, role.min_replicas) == (1, 1)
    cmd = command(app)
    assert cmd[0] == "torchrun"
    assert flag(cmd, "--rdzv_backend") == "c10d"
    assert flag(cmd, "--rdzv_endpoint") == "localhost:0"
    # What torchrun would set for 2 processes, set for it so it prints no banner; 1 process keeps every core.
    assert role.env["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in train(nproc_per_node=1).roles[0].env
    assert train(env={"OMP_NUM_THREADS": "4"}).roles[0].env["OMP_NUM_THREADS"] == "4"
    assert flag(cmd, "--nnodes") == "1"
    assert flag(cmd, "--nproc_per_node") == "2"
    assert flag(cmd, "--max_restarts") == "3" and role.max_retries == 3
    assert cmd[cmd.index("-m") + 1] == "elastic_ft.worker"
    assert flag(cmd, "--spec") == "specs/tiny-lora.yaml"
    assert flag(cmd, "--checkpoint_uri") == "file://./runs"
    assert "--run_id" not in cmd


def test_elastic_nnodes_and_replicas():
    app = train(nnodes="2:5", run_id="job1")
    (role,) = app.roles
    assert (role.num_replicas, role.min_replicas) == (5, 2)
    cmd = command(app)
    assert flag(cmd, "--nnodes") == "2:5"
    assert flag(cmd, "--rdzv_id") == "job1" and flag(cmd, "--run_id") == "job1"
    assert app.name == "elastic-ft-job1"
    # several nodes and no endpoint: the rank-0 host variable, left for bash to expand
    assert "--rdzv_endpoint ${" in app.roles[0].args[1]
    (role,) = train(nnodes="2:5", replicas=3).roles
    assert (role.num_replicas, role.min_replicas) == (3, 2)


def test_replicas_zero_means_max_nnodes():
    # torchx passes every argument from the command line; 0 is "not given".
    (role,) = train(nnodes="2:5", replicas=0).roles
    assert role.num_replicas == 5


@pytest.mark.parametrize("replicas", [-1, 6])
def test_replicas_out_of_range(replicas):
    with pytest.raises(ValueError, match="--replicas"):
        train(nnodes="2:5", replicas=replicas)


def test_etcd3_needs_endpoint():
    with pytest.raises(ValueError, match="etcd3 needs --rdzv_endpoint"):
        train(rdzv_backend="etcd3")
    cmd = command(train(rdzv_backend="etcd3", rdzv_endpoint="etcd.example:2379", rdzv_conf="join_timeout=600"))
    assert flag(cmd, "--rdzv_backend") == "etcd3"
    assert flag(cmd, "--rdzv_endpoint") == "etcd.example:2379"
    assert flag(cmd, "--rdzv_conf") == "join_timeout=600"


def test_overrides_and_options_passed_through():
    app = train("optimizer.lr=1e-4", "model.config.name=it's", spec="my spec.yaml", checkpoint_uri="s3://b/p",
                log_dir="/tmp/logs", env={"AWS_REGION": "us-east-1"}, max_restarts=0)
    cmd = command(app)
    assert cmd[-2:] == ["optimizer.lr=1e-4", "model.config.name=it's"]  # quoted for bash, intact
    assert flag(cmd, "--spec") == "my spec.yaml"
    assert flag(cmd, "--checkpoint_uri") == "s3://b/p"
    assert flag(cmd, "--log_dir") == "/tmp/logs"
    (role,) = app.roles
    assert role.env["AWS_REGION"] == "us-east-1"
    assert role.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert role.max_retries == 0


@pytest.mark.parametrize("kwargs,match", [({"nproc_per_node": -1}, "--nproc_per_node"),
                                          ({"max_restarts": -1}, "--max_restarts"),
                                          ({"nnodes": "x"}, "--nnodes")])
def test_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        train(**kwargs)


@pytest.mark.parametrize("run_id", ["../escaped", "..", ".", "a/b", "/abs", ".hidden", "-x", "x y", "é", "",
                                    "r" * 129])
def test_run_id_must_be_one_safe_path_component(run_id):
    # '../escaped' wrote checkpoints outside checkpoint_uri and logs outside torchx's log dir.
    with pytest.raises(ValueError, match="^--run_id "):
        train(run_id=run_id)


@pytest.mark.parametrize("uri, expected", [
    ("s3://bucket/../x", "has a '..' path segment"),
    ("s3://bucket/runs/.", "has a '.' path segment"),
    ("file://host/runs", "file:///absolute/path"),
    ("gs://bucket/runs", "gs"),
])
def test_a_checkpoint_uri_the_workers_would_refuse_is_refused_at_submission(uri, expected):
    with pytest.raises(ValueError) as info:
        train(checkpoint_uri=uri)
    message = str(info.value)
    assert uri in message and expected in message, message


@pytest.mark.parametrize("run_id", ["job1", "Run-2.b_c", "r" * 128, "0"])
def test_valid_run_ids_pass_through(run_id):
    cmd = command(train(run_id=run_id))
    assert flag(cmd, "--run_id") == run_id and flag(cmd, "--rdzv_id") == run_id


@pytest.mark.parametrize("conf", ["password=s3cret", "join_timeout=600, password =s3cret", "password"])
def test_password_in_rdzv_conf_is_refused_naming_password_env(conf):
    with pytest.raises(ValueError, match="--rdzv_conf: password= .* give password_env=VAR") as info:
        train(rdzv_backend="etcd3", rdzv_endpoint="etcd.example:2379", rdzv_conf=conf)
    assert "s3cret" not in str(info.value)


def test_rendezvous_key_in_env_is_refused_naming_the_secret_ways():
    from elastic_ft.rendezvous.state_codec import KEY_ENV

    with pytest.raises(ValueError, match=f"--env: {KEY_ENV} would put the rendezvous key on the command line") as info:
        train(rdzv_backend="etcd3", rdzv_endpoint="etcd.example:2379", env={KEY_ENV: "s3cret-key-0123456789"})
    assert "s3cret" not in str(info.value) and f"secrets={KEY_ENV}:ARN" in str(info.value)


def test_password_env_in_rdzv_conf_is_passed_through():
    conf = "user=root,password_env=ETCD_PASSWORD,ca_cert=/etc/etcd/ca.pem"
    cmd = command(train(rdzv_backend="etcd3", rdzv_endpoint="etcd.example:2379", rdzv_conf=conf))
    assert flag(cmd, "--rdzv_conf") == conf


def dryrun_app(*args: str, scheduler: str = "local_cwd"):
    """torchx's own dry run of ``elastic_ft.train ARGS`` (its argument parsing included): the AppDef it plans."""
    from torchx.runner import get_runner

    with get_runner() as runner:
        return runner.dryrun_component("elastic_ft.train", list(args), scheduler, cfg={})._app


def test_gpu_nodes_run_one_process_per_gpu_by_default():
    app = dryrun_app("--gpu", "4")
    (role,) = app.roles
    assert role.resource.gpu == 4
    assert flag(command(app), "--nproc_per_node") == "4"
    assert flag(command(dryrun_app("--gpu", "4", "--nproc_per_node", "2")), "--nproc_per_node") == "2"
    assert flag(command(dryrun_app()), "--nproc_per_node") == "2"  # a CPU node's default


def test_more_processes_than_gpus_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"--nproc_per_node 8 is more than the node's 4 GPU\(s\)"):
        train(gpu=4, nproc_per_node=8)
    with pytest.raises(ValueError, match="--gpu must be 0 or more"):
        train(gpu=-1)


def test_nccl_and_efa_settings_of_the_submitter_reach_the_nodes(monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("FI_PROVIDER", "efa")
    monkeypatch.setenv("FI_EFA_USE_DEVICE_RDMA", "1")
    monkeypatch.setenv("OFI_NCCL_DISABLE_GDR_REQUIRED_CHECK", "1")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    monkeypatch.setenv("ELASTIC_FT_UNRELATED", "x")
    (role,) = dryrun_app("--gpu", "8", "--env", "NCCL_DEBUG=WARN").roles
    assert role.env["FI_PROVIDER"] == "efa" and role.env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert role.env["OFI_NCCL_DISABLE_GDR_REQUIRED_CHECK"] == "1" and role.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert role.env["NCCL_DEBUG"] == "WARN"  # --env wins over the submitting environment
    assert "ELASTIC_FT_UNRELATED" not in role.env


EFA = "vpc.amazonaws.com/efa"


def test_efa_interfaces_follow_the_named_host_type_or_efa():
    (p4d,) = dryrun_app("--h", "aws_p4d.24xlarge").roles
    assert p4d.resource.devices == {EFA: 4} and p4d.resource.gpu == 8
    assert p4d.env["FI_PROVIDER"] == "efa"  # libfabric must not fall back to TCP sockets silently
    (given,) = dryrun_app("--gpu", "8", "--efa", "2").roles
    assert given.resource.devices == {EFA: 2} and given.env["FI_PROVIDER"] == "efa"
    (off,) = dryrun_app("--h", "aws_p4d.24xlarge", "--efa", "0").roles
    assert off.resource.devices == {} and "FI_PROVIDER" not in off.env
    (plain,) = dryrun_app("--gpu", "8").roles
    assert plain.resource.devices == {} and "FI_PROVIDER" not in plain.env
    (own,) = dryrun_app("--gpu", "8", "--efa", "1", "--env", "FI_PROVIDER=tcp").roles
    assert own.env["FI_PROVIDER"] == "tcp"  # --env wins
    with pytest.raises(ValueError, match="--efa must be -1"):
        train(efa=-2)


# Shell injection: every user-supplied argument is quoted in the nodes' bash line, or refused.

from elastic_ft.submission.arguments import ComponentArgumentError, check_rdzv_endpoint  # noqa: E402
from tests.unit.injection import PROBES, QUOTED, REFUSED, fired, probes, received, run_planned  # noqa: E402
from tests.unit.injection import markers  # noqa: E402,F401 - the fixture


def local_cwd_request(*args: str):
    """The first replica local_cwd would start for ``elastic_ft.train ARGS`` (torchx's parsing and macros applied)."""
    from torchx.runner import get_runner

    with get_runner() as runner:
        info = runner.dryrun_component("elastic_ft.train", ["--nproc_per_node", "1", *args], "local_cwd", cfg={})
    return info.request.role_params["trainer"][0]


@pytest.mark.subprocess  # runs bash / a child python
@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.parametrize("flag,template", QUOTED)
def test_user_text_reaches_torchrun_intact_on_local_cwd(flag, template, probe, markers, tmp_path):
    text = template.replace("@", probes(markers)[probe])
    replica = local_cwd_request(flag, text)
    assert replica.args[-2] == "-c"
    argv, environ = run_planned(replica.args[-1], replica.env, tmp_path)
    assert fired(markers) == []
    assert received(flag, argv, environ) == text


@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.parametrize("flag,template", REFUSED)
def test_text_that_is_no_endpoint_run_id_env_name_or_node_count_is_refused(flag, template, probe, markers):
    # --rdzv_endpoint 'h:2379$(cmd)' was left unquoted for bash ("$" meant the rank-0 variable): cmd ran on every node.
    text = template.replace("@", probes(markers)[probe])
    with pytest.raises(ComponentArgumentError) as info:
        local_cwd_request(flag, text)
    message = str(info.value)
    assert message.startswith(flag) and "\n" not in message, message
    assert fired(markers) == []


@pytest.mark.subprocess  # runs bash / a child python
def test_the_default_rank0_endpoint_is_the_one_text_bash_expands(tmp_path):
    replica = local_cwd_request("--nnodes", "2")
    argv, _ = run_planned(replica.args[-1], replica.env, tmp_path)
    assert flag(argv, "--rdzv_endpoint") == f"{replica.env['TORCHX_RANK0_HOST']}:29500"
    # The same text given by a user is refused (it is no HOST:PORT), never expanded.
    with pytest.raises(ComponentArgumentError, match="^--rdzv_endpoint"):
        train(nnodes="2", rdzv_endpoint="${TORCHX_RANK0_HOST:=localhost}:29500")


@pytest.mark.parametrize("name", ["BASH_FUNC_torchrun%%", "BASH_ENV", "SHELLOPTS", "PS4", "1X", "A-B", ""])
def test_env_names_bash_would_act_on_are_refused(name, markers, tmp_path):
    # bash imports BASH_FUNC_torchrun%% as a function that replaces torchrun; BASH_ENV names a file it sources first.
    value = f"() {{ touch {markers}/function; }}" if name.startswith("BASH_FUNC") else "x"
    with pytest.raises(ComponentArgumentError, match="^--env: "):
        train(env={name: value})
    assert fired(markers) == []


@pytest.mark.parametrize("endpoint,backend", [
    ("10.0.0.5:2379", "etcd3"), ("etcd-0.example.com:2379,etcd-1:2379,etcd_2:2379", "etcd3"),
    ("[::1]:2379", "etcd3"), ("[fd00::5]:2379,10.0.0.6:2379", "etcd3"), ("localhost:0", "c10d"),
    ("node-1:29500", "c10d"), ("h:65535", "static"),
])
def test_endpoints_of_host_port_items_pass(endpoint, backend):
    check_rdzv_endpoint(endpoint, backend)
    args = dict(rdzv_backend=backend, rdzv_endpoint=endpoint)
    assert flag(command(train(**args)), "--rdzv_endpoint") == endpoint


@pytest.mark.parametrize("endpoint,backend,why", [
    ("h", "etcd3", "is not HOST:PORT"), ("h:", "etcd3", "is not HOST:PORT"), (":2379", "etcd3", "is not HOST:PORT"),
    ("http://h:2379", "etcd3", "is not HOST:PORT"), ("h:2379 ", "etcd3", "is not HOST:PORT"),
    ("h:2379,", "etcd3", "is not HOST:PORT"), ("", "etcd3", "is not HOST:PORT"), ("-h:1", "etcd3", "is not HOST:PORT"),
    ("h:70000", "etcd3", "must be between 1 and 65535"), ("h:0", "etcd3", "must be between 1 and 65535"),
    ("a:1,b:2", "c10d", "c10d takes at most 1"), (",".join(["h:1"] * 17), "etcd3", "etcd3 takes at most 16"),
    ("h" * 254 + ":1", "etcd3", "is not HOST:PORT"), ("${X}:29500", "c10d", "is not HOST:PORT"),
])
def test_endpoints_that_are_no_host_port_list_are_refused_naming_the_flag(endpoint, backend, why):
    with pytest.raises(ValueError, match="^--rdzv_endpoint ") as info:
        check_rdzv_endpoint(endpoint, backend)
    assert why in str(info.value) and "\n" not in str(info.value)


def _torchx_local_cwd(tmp_path, *args: str):
    """``torchx run -s local_cwd elastic_ft.train ARGS`` as a user runs it, in a work directory of tmp_path."""
    from tests.conftest import BIN, run

    work = tmp_path / "work"
    work.mkdir()
    cmd = [os.path.join(BIN, "torchx"), "run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path}/torchx-logs",
           "elastic_ft.train", "--nproc_per_node", "1", "--max_restarts", "0", *args]
    return run(cmd, cwd=str(work), timeout=300)


@pytest.mark.torchrun
@pytest.mark.slow
def test_probes_in_every_quoted_argument_run_nothing_on_local_cwd(markers, tmp_path):
    """One real local_cwd job with every probe in every argument that is quoted: torchrun starts, nothing else runs."""
    from tests.conftest import explain

    every = "".join(probes(markers).values())
    spec = f"specs/x{every}.yaml"
    # rdzv_conf: a key torch's c10d ignores, so that torchrun goes on to start the worker.
    proc = _torchx_local_cwd(tmp_path, "--spec", spec, "--log_dir", f"logs{every}", "--checkpoint_uri",
                             f"file://./runs{every}", "--rdzv_conf", f"note=x{every}", "--env", f"X=a{every}",
                             "--", f"steps=1{every}")
    assert proc.returncode != 0, explain(proc)
    assert fired(markers) == [], explain(proc)
    # The worker got the spec path whole, and refused it as a file that does not exist.
    assert f"file {spec!r} does not exist" in proc.stdout + proc.stderr, explain(proc)


@pytest.mark.torchrun
@pytest.mark.slow
def test_an_endpoint_probe_is_refused_before_anything_runs_on_local_cwd(markers, tmp_path):
    # 'localhost:0$(touch M)' was left unquoted: bash ran touch on every node before torchrun.
    from tests.conftest import explain

    every = "".join(probes(markers).values())
    proc = _torchx_local_cwd(tmp_path, "--rdzv_endpoint", f"localhost:0{every}", "--", "steps=1")
    assert fired(markers) == [], explain(proc)
    assert proc.returncode == 1, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    assert proc.stderr.strip().splitlines()[-1].strip().startswith("--rdzv_endpoint 'localhost:0$(touch "), explain(proc)
    assert not (tmp_path / "work" / "runs").exists(), explain(proc)


# Under constant_global a world larger than global_batch cannot step: refused at submission.

SPEC_8B = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "specs", "llama-3.1-8b-lora-spot.yaml")


def test_8_nodes_of_8_gpus_over_the_8b_specs_global_batch_is_refused_naming_both():
    # The 8B spec (global_batch 32) on up to 8 nodes of 8 GPUs: the restart a joining node caused ended the run.
    with pytest.raises(ComponentArgumentError) as info:
        train(spec=SPEC_8B, nnodes="2:8", gpu=8, rdzv_backend="etcd3", rdzv_endpoint="10.0.0.5:2379")
    message = str(info.value)
    assert message.startswith("--nnodes 2:8 x --nproc_per_node 8 = 64 processes at most, more than "
                              "batch.global_batch 32 of "), message
    assert "give --nnodes with a max of at most 4" in message and "batch.global_batch=64" in message, message
    assert "\n" not in message


@pytest.mark.parametrize("overrides,kwargs", [
    (("batch.global_batch=64",), {}),  # raised by an override, as the worker will read it
    ((), {"nnodes": "2:4"}),  # 4 x 8 = 32: every process one sample
    (("batch.policy=scale_with_world",), {}),  # the global batch follows the world
])
def test_a_world_the_batch_fits_passes(overrides, kwargs):
    args = {"spec": SPEC_8B, "nnodes": "2:8", "gpu": 8, "rdzv_backend": "etcd3", "rdzv_endpoint": "10.0.0.5:2379",
            **kwargs}
    assert flag(command(train(*overrides, **args)), "--nproc_per_node") == "8"


def test_more_processes_per_node_than_the_global_batch_names_nproc():
    with pytest.raises(ComponentArgumentError, match=r"--nproc_per_node 4 = 4 processes .* give --nproc_per_node at "
                                                     r"most 2, or raise batch.global_batch"):
        train("batch.global_batch=2", nproc_per_node=4)


def test_a_spec_not_readable_at_submission_is_left_to_the_worker(tmp_path):
    # On aws_batch the spec may exist only in the image; a broken one is reported by the worker, as before.
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch: [\n")
    for spec in (str(tmp_path / "missing.yaml"), str(bad)):
        assert flag(command(train(spec=spec, nnodes="64", nproc_per_node=8)), "--spec") == spec


@pytest.mark.torchrun
def test_torchx_refuses_the_world_in_one_line():
    from tests.conftest import BIN, explain, run

    proc = run([os.path.join(BIN, "torchx"), "run", "--dryrun", "-s", "local_cwd", "elastic_ft.train", "--nnodes",
                "1:20", "--nproc_per_node", "2"], timeout=120)
    assert proc.returncode == 1, explain(proc)
    assert "Traceback" not in proc.stderr and "=== SCHEDULER REQUEST ===" not in proc.stdout, explain(proc)
    last = proc.stderr.strip().splitlines()[-1].strip()
    assert last.startswith("--nnodes 1:20 x --nproc_per_node 2 = 40 processes at most, more than batch.global_batch "
                           "32 of 'specs/tiny-lora.yaml' under batch.policy constant_global"), explain(proc)


def test_every_node_knows_its_job_across_restarts():
    # The writer lease lets a restart of the same job (a new leader, perhaps on another node) take the run
    # over at once: the job's identity is torchx's app id, the same on every node and every restart.
    from torchx.specs import macros

    (role,) = train().roles
    assert role.env["ELASTIC_FT_JOB_ID"] == macros.app_id
    resolved = macros.Values(img_root="", app_id="app-123", replica_id="0", rank0_env="").apply(role)
    assert resolved.env["ELASTIC_FT_JOB_ID"] == "app-123"
