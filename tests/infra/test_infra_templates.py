"""The CloudFormation templates lint clean and keep their security properties.

Every property check of ``cfn_checks`` is run on the real template and on a
copy with the property removed or weakened, which it must report.
"""

from __future__ import annotations

import re
import subprocess

import pytest

import cfn_checks as checks
from conftest import AWS, TEMPLATES, load_template, tool


@pytest.mark.infra
@pytest.mark.parametrize("name", TEMPLATES)
def test_template_passes_cfn_lint(name):
    result = subprocess.run([tool("cfn-lint"), str(AWS / f"{name}.yaml")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.infra
def test_cfn_lint_reports_a_broken_template(tmp_path):
    text = (AWS / "batch.yaml").read_text().replace("AllocationStrategy: SPOT_PRICE_CAPACITY_OPTIMIZED",
                                                    "AllocationStrategy: CHEAPEST_PLEASE")
    broken = tmp_path / "batch.yaml"
    broken.write_text(text)
    result = subprocess.run([tool("cfn-lint"), str(broken)], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "cheapest_please" in result.stdout.lower()


def test_bucket_is_encrypted_private_and_aborts_incomplete_uploads():
    assert checks.bucket_problems(load_template("storage")) == []


@pytest.mark.parametrize("mutate, expected", [
    (lambda b: b.pop("BucketEncryption"), "default encryption"),
    (lambda b: b["BucketEncryption"]["ServerSideEncryptionConfiguration"][0]["ServerSideEncryptionByDefault"]
     .__setitem__("SSEAlgorithm", {"Fn::If": ["UseKms", "aws:kms", "none"]}), "default encryption"),
    (lambda b: b["PublicAccessBlockConfiguration"].pop("RestrictPublicBuckets"), "RestrictPublicBuckets"),
    (lambda b: b["LifecycleConfiguration"]["Rules"].pop(0), "multipart"),
])
def test_bucket_check_catches_a_weakened_bucket(mutate, expected):
    template = load_template("storage")
    mutate(template["Resources"]["Bucket"]["Properties"])
    assert any(expected in p for p in checks.bucket_problems(template))


def test_job_role_reaches_only_the_bucket_prefixes():
    assert checks.job_role_problems(load_template("batch")) == []


def _job_statements(template):
    return template["Resources"]["JobRole"]["Properties"]["Policies"][0]["PolicyDocument"]["Statement"]


@pytest.mark.parametrize("mutate, expected", [
    # Writing anywhere in the bucket.
    (lambda s: s[0]["Resource"][0]["Fn::Sub"].__setitem__(0, "${BucketArn}/*"), "s3:PutObject"),
    # Writing to the inputs.
    (lambda s: s[1]["Action"].append("s3:PutObject"), "s3:PutObject"),
    # Listing the whole bucket.
    (lambda s: s[2].pop("Condition"), "s3:ListBucket"),
    (lambda s: s.append({"Effect": "Allow", "Action": "s3:*", "Resource": "*"}), "s3:*"),
    (lambda s: s.append({"Effect": "Allow", "Action": ["ec2:DescribeInstances"], "Resource": "*"}), "ec2:"),
])
def test_job_role_check_catches_a_wider_policy(mutate, expected):
    template = load_template("batch")
    mutate(_job_statements(template))
    assert any(expected in p for p in checks.job_role_problems(template))


def test_instance_role_has_only_what_ecs_needs():
    template = load_template("batch")
    assert checks.instance_role_problems(template) == []
    template["Resources"]["InstanceRole"]["Properties"]["ManagedPolicyArns"].append(
        "arn:aws:iam::aws:policy/AmazonS3FullAccess")
    assert checks.instance_role_problems(template)


def test_spot_environment_is_price_capacity_optimized_and_first():
    assert checks.spot_problems(load_template("batch")) == []


@pytest.mark.parametrize("mutate, expected", [
    (lambda r: r["SpotComputeEnvironment"]["Properties"]["ComputeResources"].__setitem__(
        "AllocationStrategy", "BEST_FIT_PROGRESSIVE"), "SPOT_PRICE_CAPACITY_OPTIMIZED"),
    (lambda r: r["JobQueue"]["Properties"]["ComputeEnvironmentOrder"].reverse() or [
        o.__setitem__("Order", i + 1) for i, o in enumerate(r["JobQueue"]["Properties"]["ComputeEnvironmentOrder"])],
     "Spot environment first"),
    (lambda r: r.pop("OnDemandComputeEnvironment"), "on-demand"),
])
def test_spot_check_catches_a_changed_environment(mutate, expected):
    template = load_template("batch")
    mutate(template["Resources"])
    assert any(expected in p for p in checks.spot_problems(template))


def test_spot_pools_span_several_gpu_instance_types():
    types = load_template("batch")["Parameters"]["SpotInstanceTypes"]["Default"].split(",")
    assert len(types) >= 3 and all(re.match(r"^(g|p)\d", t) for t in types), types


def test_batch_launch_template_lets_containers_use_imdsv2():
    template = load_template("batch")
    assert checks.batch_launch_template_problems(template) == []
    meta = template["Resources"]["LaunchTemplate"]["Properties"]["LaunchTemplateData"]["MetadataOptions"]
    meta["HttpPutResponseHopLimit"] = 1
    meta["HttpTokens"] = "optional"
    problems = checks.batch_launch_template_problems(template)
    assert any("HttpTokens" in p for p in problems) and any("HopLimit" in p for p in problems)


def test_etcd_members_are_three_on_demand_instances():
    template = load_template("etcd")
    assert checks.etcd_group_problems(template) == []
    template["Resources"]["MemberGroup"]["Properties"]["MaxSize"] = "6"
    assert any("min = max = desired = 3" in p for p in checks.etcd_group_problems(template))
    template = load_template("etcd")
    template["Resources"]["LaunchTemplate"]["Properties"]["LaunchTemplateData"]["InstanceMarketOptions"] = {
        "MarketType": "spot"}
    assert any("Spot" in p for p in checks.etcd_group_problems(template))


@pytest.mark.parametrize("name", TEMPLATES)
def test_no_security_group_takes_traffic_from_an_address_range(name):
    assert checks.ingress_problems(load_template(name)) == []


@pytest.mark.parametrize("rule, expected", [
    ({"GroupId": {"Ref": "TrainingSecurityGroup"}, "CidrIp": "0.0.0.0/0", "IpProtocol": "tcp",
      "FromPort": 22, "ToPort": 22}, "0.0.0.0/0"),
    ({"GroupId": {"Ref": "EtcdSecurityGroup"}, "SourceSecurityGroupId": {"Ref": "TrainingSecurityGroup"},
      "IpProtocol": "-1"}, "2379 only"),
])
def test_ingress_check_catches_an_open_rule(rule, expected):
    template = load_template("network")
    template["Resources"]["Extra"] = {"Type": "AWS::EC2::SecurityGroupIngress", "Properties": rule}
    assert any(expected in p for p in checks.ingress_problems(template))


@pytest.mark.parametrize("name", TEMPLATES)
def test_secrets_enter_only_as_secret_references(name):
    template = load_template(name)
    assert checks.secret_parameter_problems(template) == []
    template.setdefault("Parameters", {})["EtcdRootPassword"] = {"Type": "String", "NoEcho": True}
    assert checks.secret_parameter_problems(template)


def test_etcd_user_data_holds_no_secret_and_reads_them_from_the_secret_store():
    text = _user_data()
    for parameter in ("EtcdTlsSecretArn", "EtcdRootPasswordSecretArn", "EtcdPasswordSecretArn"):
        assert f"--secret-id '${{{parameter}}}'" in text
    assert "BEGIN" not in text and "PRIVATE KEY" not in text
    # Passwords reach etcdctl on stdin, never as arguments.
    assert "--new-user-password" not in text and ":$" not in text.split("user add")[-1].split("\n")[0]


@pytest.mark.infra
def test_etcd_user_data_passes_shellcheck(tmp_path):
    # ${Name} are CloudFormation's substitutions: stand-ins make it plain bash.
    script = re.sub(r"\$\{([A-Za-z0-9:]+)\}", lambda m: "CFN_" + m.group(1).replace(":", "_"), _user_data())
    path = tmp_path / "user-data.sh"
    path.write_text(script)
    result = subprocess.run([tool("shellcheck"), "-s", "bash", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def _user_data() -> str:
    data = load_template("etcd")["Resources"]["LaunchTemplate"]["Properties"]["LaunchTemplateData"]
    return str(data["UserData"]["Fn::Base64"]["Fn::Sub"][0])


def test_etcd_training_user_is_limited_to_its_prefix_and_root_is_apart():
    assert checks.etcd_rbac_problems(load_template("etcd")) == []


@pytest.mark.parametrize("old,new,expected", [
    ("etcdctl role grant-permission training --prefix=true readwrite '${TrainingKeyPrefix}'", "true",
     "the training role may read and write the prefix"),
    ("--prefix=true readwrite '${TrainingKeyPrefix}'", "--prefix=true readwrite '/'", "a permission beyond"),
    ("readwrite '${TrainingKeyPrefix}'", "readwrite '${TrainingKeyPrefix}' '/zzz'", "a permission beyond"),
    ("etcdctl user grant-role training training", "etcdctl user grant-role training root",
     "user training must have only its own role, not root"),
    ("etcdctl user grant-role root root", "true", "root has the root role"),
    ("'${EtcdRootPasswordSecretArn}'", "'${EtcdPasswordSecretArn}'",
     "user root must be added with the password read from EtcdRootPasswordSecretArn"),
    ("etcdctl user add training", "etcdctl user add trainer", "user training must be added"),
    ("etcdctl auth enable\n", "", "never runs 'etcdctl auth enable'"),
])
def test_rbac_check_catches_a_wider_or_missing_grant(old, new, expected):
    template = load_template("etcd")
    sub = template["Resources"]["LaunchTemplate"]["Properties"]["LaunchTemplateData"]["UserData"]["Fn::Base64"]["Fn::Sub"]
    assert old in sub[0]
    sub[0] = sub[0].replace(old, new)
    assert any(expected in p for p in checks.etcd_rbac_problems(template)), checks.etcd_rbac_problems(template)


def test_rbac_check_catches_auth_enabled_before_the_grants():
    template = load_template("etcd")
    sub = template["Resources"]["LaunchTemplate"]["Properties"]["LaunchTemplateData"]["UserData"]["Fn::Base64"]["Fn::Sub"]
    assert sub[0].count("etcdctl auth enable\n") == 1
    text = sub[0].replace("etcdctl auth enable\n", "")
    sub[0] = text.replace("etcdctl user get root", "etcdctl auth enable\netcdctl user get root")
    assert any("only after 'auth enable'" in p for p in checks.etcd_rbac_problems(template))


def test_rbac_check_catches_a_prefix_parameter_that_allows_every_key():
    template = load_template("etcd")
    template["Parameters"]["TrainingKeyPrefix"]["AllowedPattern"] = "^/[A-Za-z0-9_./-]*/?$"
    assert any("must refuse '/'" in p for p in checks.etcd_rbac_problems(template))


def test_etcd_compacts_its_history_and_has_a_quota():
    assert checks.etcd_storage_problems(load_template("etcd")) == []


@pytest.mark.parametrize("old,new,expected", [
    ("ETCD_AUTO_COMPACTION_MODE=periodic\n", "", "ETCD_AUTO_COMPACTION_MODE is None"),
    ("ETCD_AUTO_COMPACTION_RETENTION=5m", "ETCD_AUTO_COMPACTION_RETENTION=72h", "at most 1h"),
    ("ETCD_AUTO_COMPACTION_MODE=periodic", "ETCD_AUTO_COMPACTION_MODE=revision", "must be a revision count"),
    ("ETCD_QUOTA_BACKEND_BYTES=4294967296\n", "", "ETCD_QUOTA_BACKEND_BYTES is missing"),
    ("ETCD_QUOTA_BACKEND_BYTES=4294967296", "ETCD_QUOTA_BACKEND_BYTES=17179869184", "outside 2 GiB"),
])
def test_storage_check_catches_a_missing_or_unbounded_setting(old, new, expected):
    template = load_template("etcd")
    sub = template["Resources"]["LaunchTemplate"]["Properties"]["LaunchTemplateData"]["UserData"]["Fn::Base64"]["Fn::Sub"]
    assert old in sub[0]
    sub[0] = sub[0].replace(old, new)
    assert any(expected in p for p in checks.etcd_storage_problems(template)), checks.etcd_storage_problems(template)


def test_storage_check_catches_a_quota_over_half_the_smallest_volume():
    template = load_template("etcd")
    template["Parameters"]["DataVolumeGiB"]["MinValue"] = 4
    assert any("over half the smallest data volume" in p for p in checks.etcd_storage_problems(template))
