"""``torchx run -s aws_batch elastic_ft.train --nnodes 2:8 --dryrun`` plans an array of single-node containers."""

from __future__ import annotations

import json
import shlex

import pytest
import torchx
from torchx.schedulers.aws_batch_scheduler import TAG_TORCHX_APPNAME, TAG_TORCHX_USER, TAG_TORCHX_VER

from elastic_ft.aws_batch.request import ArrayJobRequest
from elastic_ft.components import train
from tests.aws_batch.conftest import CHECKPOINTS, ETCD, RUN_ID, dryrun, scheduler_request, torchx as torchx_cli, train_args
from elastic_ft.submission.arguments import ComponentArgumentError
from tests.conftest import explain
from tests.unit.injection import PROBES, QUOTED, REFUSED, fired, probes, received, run_planned
from tests.unit.injection import markers  # noqa: F401 - the fixture

LINE = (
    f"torchrun --rdzv_backend etcd3 --rdzv_endpoint {ETCD} --rdzv_id {RUN_ID} --nnodes 2:8 "
    f"--nproc_per_node 2 --max_restarts 3 -m elastic_ft.worker --spec specs/tiny-lora.yaml "
    f"--checkpoint_uri {CHECKPOINTS} --run_id {RUN_ID} steps=5"
)
RULES = [
    {"onStatusReason": "Host EC2*", "action": "RETRY"},
    {"onExitCode": "75", "action": "RETRY"},
    {"onExitCode": "0", "action": "EXIT"},
    {"onReason": "*", "action": "EXIT"},
]
MNP_WORDS = ["multinode", "nodeProperties", "AWS_BATCH_JOB_NODE_INDEX", "AWS_BATCH_JOB_MAIN_NODE", "targetNodes"]


def test_nnodes_2_8_is_an_array_of_8_single_node_containers():
    request = dryrun(train_args()).request
    assert isinstance(request, ArrayJobRequest)
    definition, submit = request.job_definition, request.submit_job
    assert definition["type"] == "container"
    assert submit["arrayProperties"] == {"size": 8}
    assert request.queue == submit["jobQueue"] == "q"
    assert request.name.startswith(f"elastic-ft-{RUN_ID}-")
    assert definition["jobDefinitionName"] == submit["jobName"] == submit["jobDefinition"] == request.name
    assert definition["retryStrategy"] == submit["retryStrategy"] == {"attempts": 10, "evaluateOnExit": RULES}
    assert request.images_to_push == {}


def test_nnodes_2_512_is_an_array_of_512_single_node_containers():
    """Issue 27's scale: 512 nodes are 512 array children, each one torchrun agent of the elastic range."""
    request = dryrun(train_args(nnodes="2:512", overrides=("steps=5", "batch.global_batch=1024"))).request
    assert isinstance(request, ArrayJobRequest)
    assert request.job_definition["type"] == "container"
    assert request.submit_job["arrayProperties"] == {"size": 512}
    command = request.job_definition["containerProperties"]["command"][2]
    assert "--nnodes 2:512 --nproc_per_node 2 " in command and command.endswith("batch.global_batch=1024")
    assert request.job_definition["retryStrategy"]["evaluateOnExit"] == RULES


def test_nnodes_2_512_with_a_global_batch_too_small_for_1024_processes_is_refused_with_the_fix():
    with pytest.raises(ComponentArgumentError, match=r"--nnodes 2:512 x --nproc_per_node 2 = 1024 processes at most"
                       r".*batch\.global_batch=1024"):
        dryrun(train_args(nnodes="2:512"))


def test_the_container_runs_torchrun_on_etcd3_with_the_run_id_and_s3_checkpoints():
    container = dryrun(train_args()).request.job_definition["containerProperties"]
    assert container["command"] == ["bash", "-c", LINE]
    assert shlex.split(LINE)[shlex.split(LINE).index("--rdzv_endpoint") + 1] == ETCD
    env = {e["name"]: e["value"] for e in container["environment"]}
    name = dryrun(train_args()).request.name.rsplit("-", 1)[0]
    assert env.pop("TORCHX_JOB_ID").startswith(f"aws_batch://torchx/{name}-")
    # the job's identity across its nodes and retries (the writer lease of its run): the submission's name
    assert env.pop("ELASTIC_FT_JOB_ID").startswith(f"{name}-")
    assert env == {
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1", "LOGLEVEL": "WARNING",
        "OMP_NUM_THREADS": "1",  # 2 processes per node: what torchrun would set, without its banner
        "TORCHX_ROLE_IDX": "0", "TORCHX_ROLE_NAME": "trainer",
    }
    assert container["resourceRequirements"] == [{"type": "VCPU", "value": "2"}, {"type": "MEMORY", "value": "8192"}]
    assert container["image"] == torchx.IMAGE
    assert container["logConfiguration"] == {"logDriver": "awslogs"}


def test_no_multinode_macros_ports_or_instance_types():
    """Batch runs EC2 container jobs on the host's network: the nodes meet at etcd, no port is mapped."""
    request = dryrun(train_args(gpu="1", nproc_per_node="1")).request
    text = json.dumps([request.job_definition, request.submit_job])
    for word in [*MNP_WORDS, "portMappings", "instanceType", "${", "rank0"]:
        assert word not in text, word


def test_tags_let_torchx_list_find_the_job():
    tags = dryrun(train_args(), user="alice").request.submit_job["tags"]
    assert tags == {
        TAG_TORCHX_VER: torchx.__version__, TAG_TORCHX_APPNAME: f"elastic-ft-{RUN_ID}", TAG_TORCHX_USER: "alice",
        "elastic_ft.component": "train", "elastic_ft.run_id": RUN_ID,
    }
    assert dryrun(train_args()).request.submit_job["propagateTags"] is True


def test_one_node_is_a_plain_container_job():
    request = dryrun(train_args(nnodes="1")).request
    assert request.job_definition["type"] == "container"
    assert "arrayProperties" not in request.submit_job
    assert "--nnodes 1 " in request.job_definition["containerProperties"]["command"][2]


def test_replicas_size_the_array_and_gpu_memory_resources():
    request = dryrun(train_args(replicas="3", gpu="1", nproc_per_node="1", memMB="28000", cpu="3")).request
    assert request.submit_job["arrayProperties"] == {"size": 3}
    assert "--nnodes 2:8 " in request.job_definition["containerProperties"]["command"][2]
    assert request.job_definition["containerProperties"]["resourceRequirements"] == [
        {"type": "VCPU", "value": "3"}, {"type": "MEMORY", "value": "28000"}, {"type": "GPU", "value": "1"},
    ]


def test_efa_interfaces_are_mounted_into_the_container():
    """The devices of an EFA host type (aws_p4d.24xlarge: 4) reach the job definition, as torchx maps them."""
    container = dryrun(train_args(h="aws_p4d.24xlarge", nproc_per_node="8", nnodes="2:4")).request.job_definition[
        "containerProperties"]
    assert container["linuxParameters"]["devices"] == [
        {"hostPath": f"/dev/infiniband/uverbs{i}", "containerPath": f"/dev/infiniband/uverbs{i}",
         "permissions": ["READ", "WRITE", "MKNOD"]} for i in range(4)
    ]
    assert {"type": "GPU", "value": "8"} in container["resourceRequirements"]
    assert {"name": "FI_PROVIDER", "value": "efa"} in container["environment"]
    plain = dryrun(train_args(gpu="1", nproc_per_node="1")).request.job_definition["containerProperties"]
    assert plain["linuxParameters"]["devices"] == []


def test_run_options_attempts_roles_and_share():
    request = dryrun(
        train_args(), attempts=4, share_id="teamA", priority=7,
        job_role_arn="arn:aws:iam::1:role/job", execution_role_arn="arn:aws:iam::1:role/exec",
    ).request
    assert request.submit_job["retryStrategy"]["attempts"] == 4
    assert request.submit_job["shareIdentifier"] == "teamA"
    assert request.submit_job["schedulingPriorityOverride"] == 7
    assert request.name.startswith(f"elastic-ft-{RUN_ID}-teamA-")
    container = request.job_definition["containerProperties"]
    assert container["jobRoleArn"] == "arn:aws:iam::1:role/job"
    assert container["executionRoleArn"] == "arn:aws:iam::1:role/exec"


def test_secrets_come_from_arns_not_values():
    password = "arn:aws:secretsmanager:us-east-1:1:secret:etcd-AbC"
    ca = "arn:aws:ssm:us-east-1:1:parameter/eft/ca"
    request = dryrun(train_args(), secrets=[f"ELASTIC_FT_ETCD_PASSWORD:{password}", f"ELASTIC_FT_ETCD_CA_PEM:{ca}"]).request
    assert request.job_definition["containerProperties"]["secrets"] == [
        {"name": "ELASTIC_FT_ETCD_PASSWORD", "valueFrom": password},
        {"name": "ELASTIC_FT_ETCD_CA_PEM", "valueFrom": ca},
    ]
    assert "secrets" not in dryrun(train_args()).request.job_definition["containerProperties"]


def test_job_names_keep_to_batch_alphabet():
    request = dryrun(train_args(run_id="llama.8b_" + "x" * 119)).request
    assert len(request.name) <= 128
    assert set(request.name) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")


@pytest.mark.torchrun
def test_cli_dryrun_prints_the_exact_requests():
    proc = torchx_cli("run", "-s", "aws_batch", "--dryrun", "-cfg", "queue=q", "elastic_ft.train", *train_args())
    assert proc.returncode == 0, explain(proc)
    calls = scheduler_request(proc.stdout)
    assert set(calls) == {"register_job_definition", "submit_job"}
    assert calls["register_job_definition"]["type"] == "container"
    assert calls["register_job_definition"]["containerProperties"]["command"] == ["bash", "-c", LINE]
    assert calls["submit_job"]["arrayProperties"] == {"size": 8}
    assert calls["submit_job"]["retryStrategy"]["evaluateOnExit"] == RULES


def test_component_marks_its_app_with_tag_safe_facts():
    meta = train(nnodes="2:8", run_id=RUN_ID, checkpoint_uri="s3://b/ä", rdzv_backend="etcd3",
                 rdzv_endpoint=ETCD).metadata
    assert meta == {
        "elastic_ft.component": "train", "elastic_ft.min_nodes": "2", "elastic_ft.max_nodes": "8",
        "elastic_ft.rdzv_backend": "etcd3", "elastic_ft.rdzv_endpoint": "given",
        "elastic_ft.checkpoint_scheme": "s3", "elastic_ft.run_id": RUN_ID,
    }
    odd = train(rdzv_backend="my$backend;", checkpoint_uri="./runs").metadata
    assert odd["elastic_ft.rdzv_backend"] == "other" and odd["elastic_ft.checkpoint_scheme"] == "other"
    assert odd["elastic_ft.run_id"] == "" and odd["elastic_ft.rdzv_endpoint"] == ""


# Shell injection: the container's bash line quotes every user-supplied argument, or the component refuses it.


def _with(flag: str, text: str) -> list[str]:
    """The good arguments with ``flag`` (``--``: the one override) given ``text``."""
    if flag == "--":
        return train_args(overrides=(text,))
    return train_args(**{flag[2:]: text})


@pytest.mark.subprocess  # runs bash / a child python
@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.parametrize("flag,template", QUOTED)
def test_user_text_reaches_torchrun_intact_in_the_container(flag, template, probe, markers, tmp_path):
    text = template.replace("@", probes(markers)[probe])
    container = dryrun(_with(flag, text)).request.job_definition["containerProperties"]
    assert container["command"][:2] == ["bash", "-c"]
    env = {e["name"]: e["value"] for e in container["environment"]}
    argv, environ = run_planned(container["command"][2], env, tmp_path)
    assert fired(markers) == []
    assert received(flag, argv, environ) == text


@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.parametrize("flag,template", REFUSED)
def test_text_that_is_no_endpoint_run_id_env_name_or_node_count_plans_nothing(flag, template, probe, markers):
    text = template.replace("@", probes(markers)[probe])
    with pytest.raises(ComponentArgumentError) as info:
        dryrun(_with(flag, text))
    assert str(info.value).startswith(flag) and "\n" not in str(info.value), str(info.value)
    assert fired(markers) == []


@pytest.mark.torchrun
def test_cli_dryrun_plans_a_container_that_runs_no_probe(markers, tmp_path):
    """``torchx run -s aws_batch --dryrun`` with every probe in every quoted argument: the printed command runs none."""
    every = "".join(probes(markers).values())
    args = train_args(overrides=(f"steps=1{every}",), spec=f"specs/x{every}.yaml", log_dir=f"logs{every}",
                      checkpoint_uri=f"s3://bucket/runs{every}", rdzv_conf=f"note=x{every}", env=f"X=a{every}")
    proc = torchx_cli("run", "-s", "aws_batch", "--dryrun", "-cfg", "queue=q", "elastic_ft.train", *args)
    assert proc.returncode == 0, explain(proc)
    container = scheduler_request(proc.stdout)["register_job_definition"]["containerProperties"]
    env = {e["name"]: e["value"] for e in container["environment"]}
    argv, environ = run_planned(container["command"][2], env, tmp_path)
    assert fired(markers) == []
    assert [flag(argv, "--spec"), flag(argv, "--log_dir"), argv[-1], environ["X"]] == [
        f"specs/x{every}.yaml", f"logs{every}", f"steps=1{every}", f"a{every}"]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("host,gpus,vcpus,mem_gib", [
    ("aws_g5.xlarge", 1, 4, 16),  # torchx's A10G type
    ("aws_g6.xlarge", 1, 4, 16),  # L4: elastic_ft.submission.host_types
    ("aws_g6.12xlarge", 4, 48, 192),
    ("aws_g6e.2xlarge", 1, 8, 64),  # L40S, the LoRA spec's pools
])
def test_24_and_48_gb_gpu_host_types_give_the_gpus_processes_and_memory(host, gpus, vcpus, mem_gib):
    """``-h`` of a g5/g6/g6e type, as of p4d/p5: its GPUs become --gpu's and --nproc_per_node's default and the
    job definition's resources (memory less the 4% Batch keeps, as torchx's types), for the Q-LoRA spec."""
    spec = str(__import__("pathlib").Path(__file__).parents[2] / "specs" / "llama-3.1-8b-qlora-spot.yaml")
    request = dryrun(train_args(h=host, nproc_per_node=None, spec=spec, overrides=())).request
    container = request.job_definition["containerProperties"]
    assert container["resourceRequirements"] == [
        {"type": "VCPU", "value": str(vcpus)}, {"type": "MEMORY", "value": str(mem_gib * int(1024 * 0.96))},
        {"type": "GPU", "value": str(gpus)},
    ]
    assert f"--nproc_per_node {gpus} " in container["command"][2]
    assert container["linuxParameters"]["devices"] == []  # no EFA unless --efa says so
