"""The torchx component (elastic_ft.components): argument checks and the AppDef it builds."""

import shlex

import pytest

from elastic_ft.components import parse_nnodes, train


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


def test_every_node_knows_its_job_across_restarts():
    # The writer lease lets a restart of the same job (a new leader, perhaps on another node) take the run
    # over at once: the job's identity is torchx's app id, the same on every node and every restart.
    from torchx.specs import macros

    (role,) = train().roles
    assert role.env["ELASTIC_FT_JOB_ID"] == macros.app_id
    resolved = macros.Values(img_root="", app_id="app-123", replica_id="0", rank0_env="").apply(role)
    assert resolved.env["ELASTIC_FT_JOB_ID"] == "app-123"
