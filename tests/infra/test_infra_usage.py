"""The 8B Spot spec and the run command of infra/aws/README.md agree with the code and the templates.

The spec goes through the project's real loader; the README's ``torchx run``
arguments through the real component, its ``--rdzv_conf`` keys against the
etcd3 backend's options, and its paths against the batch stack's prefixes.
"""

from __future__ import annotations

import re
import shlex

import pytest

from conftest import AWS, REPO, load_template
from elastic_ft.aws_batch.request import problems
from elastic_ft.components import train
from elastic_ft.config import load_spec
from elastic_ft.rendezvous.options import KNOWN_OPTIONS

SPEC = REPO / "specs" / "llama-3.1-8b-lora-spot.yaml"
README = (AWS / "README.md").read_text()


def _torchx_run() -> list[str]:
    """The README's ``torchx run`` command as argv (line continuations joined, shell functions left as words)."""
    block = re.search(r"^torchx run -s aws_batch.*?(?<!\\)\n", README, re.MULTILINE | re.DOTALL)
    assert block, "infra/aws/README.md has no torchx run -s aws_batch command"
    return shlex.split(block.group(0).replace("\\\n", " "))


def _component_args(argv: list[str]) -> dict[str, str]:
    """The ``--name value`` pairs after the component name."""
    rest = argv[argv.index("elastic_ft.train") + 1:]
    assert len(rest) % 2 == 0, rest
    return {rest[i].removeprefix("--"): rest[i + 1] for i in range(0, len(rest), 2)}


def test_8b_spec_loads_and_validates_through_the_real_loader():
    spec = load_spec(str(SPEC))
    assert spec.name == "llama-3.1-8b-lora"
    assert spec.model.name_or_path.endswith("/Llama-3.1-8B-Instruct") and spec.model.config is None
    assert spec.model.dtype == "float32" and spec.model.gradient_checkpointing
    assert (spec.precision.param_dtype, spec.precision.compute) == ("bfloat16", "bfloat16")
    assert spec.lora is not None and spec.lora.r == 16 and spec.lora.alpha == 32
    assert set(spec.lora.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"}
    assert spec.data.max_length == 2048 and (spec.data.prompt_field, spec.data.response_field) == ("prompt", "response")
    # The same gradient at any world from 2 to 8 nodes.
    assert spec.batch.policy == "constant_global" and spec.batch.global_batch >= 8 * spec.batch.micro_batch
    assert spec.steps == 1000 and spec.checkpoint.every_steps == 50


def test_8b_spec_reads_its_inputs_from_the_prefix_the_job_role_may_read():
    spec = load_spec(str(SPEC))
    inputs = load_template("batch")["Parameters"]["InputsPrefix"]["Default"]
    for uri in [spec.model.name_or_path, *spec.data.files]:
        assert re.match(rf"^s3://elastic-ft-example/{inputs}/", uri), uri


def test_8b_spec_is_refused_when_broken(tmp_path):
    broken = tmp_path / "spec.yaml"
    broken.write_text(SPEC.read_text().replace("micro_batch: 1", "micro_batch: 0"))
    with pytest.raises(ValueError, match="batch.micro_batch"):
        load_spec(str(broken))


def test_readme_run_command_is_accepted_by_the_component():
    argv = _torchx_run()
    args = _component_args(argv)
    app = train(
        nnodes=args["nnodes"], nproc_per_node=int(args["nproc_per_node"]), gpu=int(args["gpu"]),
        cpu=int(args["cpu"]), memMB=int(args["memMB"]), image=args["image"], spec=args["spec"],
        run_id=args["run_id"], checkpoint_uri=args["checkpoint_uri"], rdzv_backend=args["rdzv_backend"],
        rdzv_endpoint=args["rdzv_endpoint"], rdzv_conf=args["rdzv_conf"], max_restarts=int(args["max_restarts"]),
    )
    role = app.roles[0]
    assert (role.min_replicas, role.num_replicas) == (2, 8)
    assert "--rdzv_backend etcd3" in role.args[-1] and "s3://elastic-ft-example/runs" in role.args[-1]


def test_readme_rdzv_conf_uses_only_options_the_etcd3_backend_knows():
    conf = dict(item.split("=", 1) for item in _component_args(_torchx_run())["rdzv_conf"].split(","))
    assert set(conf) <= set(KNOWN_OPTIONS), set(conf) - set(KNOWN_OPTIONS)
    assert "password" not in conf and conf["password_env"] == "ELASTIC_FT_ETCD_PASSWORD"
    # Where the image's entrypoint writes the CA.
    dockerfile = (REPO / "Dockerfile").read_text()
    etcd_dir = re.search(r"ELASTIC_FT_ETCD_DIR=(\S+)", dockerfile).group(1)
    assert conf["ca_cert"] == f"{etcd_dir}/ca.pem"


def test_readme_run_command_uses_the_stack_outputs_and_prefixes():
    argv = " ".join(_torchx_run())
    outputs = {**load_template("batch")["Outputs"], **load_template("etcd")["Outputs"]}
    for name in re.findall(r"\$\(out elastic-ft-batch (\w+)\)", argv):
        assert name in outputs, name
    checkpoints = load_template("batch")["Parameters"]["CheckpointPrefix"]["Default"]
    assert f"--checkpoint_uri s3://elastic-ft-example/{checkpoints}" in argv
    user = load_template("etcd")["Outputs"]["TrainingUser"]["Value"]
    assert f"user={user}," in argv


def test_readme_run_command_gives_the_nodes_the_etcd_secrets_the_image_reads():
    """The -cfg of the README's command passes the scheduler's checks and names the variables the
    rendezvous (password_env) and the image's entrypoint (the CA) read."""
    argv = _torchx_run()
    cfg = dict(item.split("=", 1) for item in argv[argv.index("-cfg") + 1].split(","))
    # What the shell makes of $(out STACK OUTPUT): an ARN.
    cfg = {k: re.sub(r"\$\(out \S+ (\w+)\)", r"arn:aws:ssm:us-east-1:123456789012:parameter/\1", v)
           for k, v in cfg.items()}
    cfg["secrets"] = cfg["secrets"].split(";")
    names = {item.split(":", 1)[0] for item in cfg["secrets"]}
    conf = dict(item.split("=", 1) for item in _component_args(argv)["rdzv_conf"].split(","))
    entrypoint = (AWS / "entrypoint.sh").read_text()
    assert conf["password_env"] in names
    assert {name for name in names if f"${{{name}" in entrypoint} == {"ELASTIC_FT_ETCD_CA_PEM"}
    args = _component_args(argv)
    app = train(
        nnodes=args["nnodes"], run_id=args["run_id"], checkpoint_uri=args["checkpoint_uri"],
        rdzv_backend=args["rdzv_backend"], rdzv_endpoint=args["rdzv_endpoint"], rdzv_conf=args["rdzv_conf"],
    )
    assert problems(app, cfg) == []
