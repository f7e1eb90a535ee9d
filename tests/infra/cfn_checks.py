"""Security properties of the CloudFormation templates in infra/aws, as pure checks.

Each check takes templates as cfn-lint's YAML loader returns them (plain
mappings; ``!Ref x`` reads as ``{"Ref": "x"}``) and returns a list of problems,
empty when the property holds. The tests run every check on the real templates
and on copies with the property removed, so a check that cannot fail shows.
"""

from __future__ import annotations

from typing import Any, Iterator

Template = dict[str, Any]

ENCRYPTING = {"AES256", "aws:kms", "aws:kms:dsse"}
# Every object action the job role may have; all but GetObject write or delete.
OBJECT_ACTIONS = {
    "s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts",
}
CHECKPOINTS = "${BucketArn}/${CheckpointPrefix}/*"
INPUTS = "${BucketArn}/${InputsPrefix}/*"
LIST_PREFIXES = {"${CheckpointPrefix}/*", "${InputsPrefix}/*"}
ECS_INSTANCE_POLICY = "arn:${AWS::Partition}:iam::aws:policy/service-role/AmazonEC2ContainerServiceforEC2Role"


def resources(template: Template, type_: str) -> dict[str, dict]:
    """The template's resources of one type, by logical name."""
    return {name: r for name, r in template.get("Resources", {}).items() if r.get("Type") == type_}


def branches(value: Any) -> list[Any]:
    """The values a property may take: both branches of an ``Fn::If``, without ``AWS::NoValue``."""
    if isinstance(value, dict) and "Fn::If" in value:
        return [v for branch in value["Fn::If"][1:] for v in branches(branch)]
    if isinstance(value, dict) and value.get("Ref") == "AWS::NoValue":
        return []
    return [value]


def as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]


def sub_text(value: Any) -> str | None:
    """The text of an ``Fn::Sub`` (short or long form), or a plain string; None otherwise."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and "Fn::Sub" in value:
        sub = value["Fn::Sub"]
        return sub if isinstance(sub, str) else sub[0]
    return None


def bucket_problems(template: Template) -> list[str]:
    """One bucket, encrypted by default, public access blocked, incomplete uploads aborted."""
    buckets = resources(template, "AWS::S3::Bucket")
    if len(buckets) != 1:
        return [f"expected one bucket, found {len(buckets)}"]
    props = next(iter(buckets.values())).get("Properties", {})
    problems = []
    rules = props.get("BucketEncryption", {}).get("ServerSideEncryptionConfiguration", [])
    algorithms = [a for r in rules for a in branches(r.get("ServerSideEncryptionByDefault", {}).get("SSEAlgorithm"))]
    if not algorithms or not set(algorithms) <= ENCRYPTING:
        problems.append(f"default encryption must be SSE-S3 or SSE-KMS in every case, got {algorithms}")
    block = props.get("PublicAccessBlockConfiguration", {})
    for key in ("BlockPublicAcls", "BlockPublicPolicy", "IgnorePublicAcls", "RestrictPublicBuckets"):
        if block.get(key) is not True:
            problems.append(f"PublicAccessBlockConfiguration.{key} must be true")
    lifecycle = props.get("LifecycleConfiguration", {}).get("Rules", [])
    if not any(r.get("Status") == "Enabled" and r.get("AbortIncompleteMultipartUpload", {}).get("DaysAfterInitiation")
               for r in lifecycle):
        problems.append("no enabled lifecycle rule aborts incomplete multipart uploads")
    return problems


def _statements(role: dict) -> Iterator[dict]:
    for policy in role.get("Properties", {}).get("Policies", []):
        for statement in policy["PolicyDocument"]["Statement"]:
            yield from branches(statement)


def _s3_problems(action: str, statement: dict) -> list[str]:
    texts = [sub_text(r) for r in as_list(statement.get("Resource"))]
    if action == "s3:ListBucket":
        prefixes = as_list(statement.get("Condition", {}).get("StringLike", {}).get("s3:prefix", []))
        shown = [sub_text(p) for p in prefixes]
        if not prefixes or not set(shown) <= LIST_PREFIXES:
            return [f"s3:ListBucket must be limited to the prefixes {sorted(LIST_PREFIXES)}, got {shown}"]
        return []
    if action not in OBJECT_ACTIONS:
        return [f"unexpected S3 action {action}"]
    allowed = {CHECKPOINTS, INPUTS} if action == "s3:GetObject" else {CHECKPOINTS}
    if not texts or not set(texts) <= allowed:
        return [f"{action} on {texts}: only {sorted(allowed)} allowed"]
    return []


def job_role_problems(template: Template, role_name: str = "JobRole") -> list[str]:
    """The job role: S3 objects only under the checkpoint prefix (read-write) and inputs (read)."""
    role = template.get("Resources", {}).get(role_name)
    if role is None:
        return [f"no resource {role_name}"]
    problems = []
    if role["Properties"].get("ManagedPolicyArns"):
        problems.append("the job role must have no managed policies")
    for statement in _statements(role):
        if statement.get("Effect") != "Allow":
            continue
        for action in as_list(statement.get("Action")):
            if action.startswith("s3:"):
                problems += _s3_problems(action, statement)
            elif action in ("kms:Decrypt", "kms:GenerateDataKey"):
                if as_list(statement.get("Resource")) != [{"Ref": "KmsKeyArn"}]:
                    problems.append(f"{action} must be limited to the bucket's key")
            else:
                problems.append(f"unexpected action {action} in the job role")
    return problems


def instance_role_problems(template: Template, role_name: str = "InstanceRole") -> list[str]:
    """The Batch instance role: ECS's managed policy for container instances, nothing more."""
    props = template.get("Resources", {}).get(role_name, {}).get("Properties", {})
    problems = []
    if [sub_text(a) for a in props.get("ManagedPolicyArns", [])] != [ECS_INSTANCE_POLICY]:
        problems.append(f"the instance role must have exactly {ECS_INSTANCE_POLICY}")
    if props.get("Policies"):
        problems.append("the instance role must have no inline policies")
    return problems


def spot_problems(template: Template) -> list[str]:
    """A Spot environment on SPOT_PRICE_CAPACITY_OPTIMIZED, an on-demand one, Spot first in the queue."""
    envs = resources(template, "AWS::Batch::ComputeEnvironment")
    spot = {n for n, r in envs.items() if r["Properties"]["ComputeResources"].get("Type") == "SPOT"}
    on_demand = {n for n, r in envs.items() if r["Properties"]["ComputeResources"].get("Type") == "EC2"}
    problems = []
    if not spot or not on_demand:
        problems.append(f"need a Spot and an on-demand environment, got Spot {spot}, on-demand {on_demand}")
    for name in spot:
        if envs[name]["Properties"]["ComputeResources"].get("AllocationStrategy") != "SPOT_PRICE_CAPACITY_OPTIMIZED":
            problems.append(f"{name}: AllocationStrategy must be SPOT_PRICE_CAPACITY_OPTIMIZED")
    for queue in resources(template, "AWS::Batch::JobQueue").values():
        order = sorted(queue["Properties"]["ComputeEnvironmentOrder"], key=lambda o: o["Order"])
        if not order or order[0]["ComputeEnvironment"].get("Ref") not in spot:
            problems.append("the job queue must try the Spot environment first")
    return problems


def batch_launch_template_problems(template: Template) -> list[str]:
    """Every launch template of a compute environment: IMDSv2 only, reachable from containers (hop limit 2)."""
    problems = []
    for name, env in resources(template, "AWS::Batch::ComputeEnvironment").items():
        ref = env["Properties"]["ComputeResources"].get("LaunchTemplate", {}).get("LaunchTemplateId", {})
        lt = template["Resources"].get(ref.get("Ref", ""), {}) if isinstance(ref, dict) else {}
        meta = lt.get("Properties", {}).get("LaunchTemplateData", {}).get("MetadataOptions", {})
        if meta.get("HttpTokens") != "required":
            problems.append(f"{name}: its launch template must set MetadataOptions.HttpTokens required")
        if meta.get("HttpPutResponseHopLimit") != 2:
            problems.append(f"{name}: its launch template must set MetadataOptions.HttpPutResponseHopLimit 2")
    return problems


def etcd_group_problems(template: Template) -> list[str]:
    """The etcd members: one group of fixed size 3, on-demand only."""
    groups = resources(template, "AWS::AutoScaling::AutoScalingGroup")
    if len(groups) != 1:
        return [f"expected one auto-scaling group, found {len(groups)}"]
    props = next(iter(groups.values()))["Properties"]
    problems = []
    sizes = {k: str(props.get(k)) for k in ("MinSize", "MaxSize", "DesiredCapacity")}
    if set(sizes.values()) != {"3"}:
        problems.append(f"the etcd group must have min = max = desired = 3, got {sizes}")
    if "MixedInstancesPolicy" in props:
        problems.append("the etcd group must not mix in Spot instances (no MixedInstancesPolicy)")
    lt = template["Resources"].get(props.get("LaunchTemplate", {}).get("LaunchTemplateId", {}).get("Ref", ""), {})
    data = lt.get("Properties", {}).get("LaunchTemplateData")
    if data is None:
        problems.append("the etcd group must use a launch template of this stack")
    elif "InstanceMarketOptions" in data:
        problems.append("the etcd launch template must not request Spot (InstanceMarketOptions)")
    return problems


def _ingress_rules(template: Template) -> Iterator[tuple[str, dict]]:
    """(group logical name or '?', rule) for inline and separate ingress rules."""
    for name, group in resources(template, "AWS::EC2::SecurityGroup").items():
        for rule in group.get("Properties", {}).get("SecurityGroupIngress", []):
            yield name, rule
    for rule in resources(template, "AWS::EC2::SecurityGroupIngress").values():
        props = rule["Properties"]
        group = props.get("GroupId")
        yield (group.get("Ref", "?") if isinstance(group, dict) else "?"), props


def ingress_problems(template: Template) -> list[str]:
    """No inbound rule from an address range: only from our security groups; etcd takes 2379 from training."""
    problems = []
    for group, rule in _ingress_rules(template):
        for key in ("CidrIp", "CidrIpv6", "SourcePrefixListId"):
            if key in rule:
                problems.append(f"{group}: inbound from {key} {rule[key]} (only security groups may be sources)")
        source = rule.get("SourceSecurityGroupId", {})
        source = source.get("Ref") if isinstance(source, dict) else source
        if group == "EtcdSecurityGroup" and source == "TrainingSecurityGroup":
            if (rule.get("IpProtocol"), rule.get("FromPort"), rule.get("ToPort")) != ("tcp", 2379, 2379):
                problems.append("training nodes may reach etcd on tcp 2379 only")
        if group == "TrainingSecurityGroup" and source != "TrainingSecurityGroup":
            problems.append(f"training nodes accept traffic only from each other, not from {source}")
    return problems


def secret_parameter_problems(template: Template) -> list[str]:
    """Passwords and keys enter only as references to secrets, never as parameter values."""
    problems = []
    for name in template.get("Parameters", {}):
        lowered = name.lower()
        if any(w in lowered for w in ("password", "tls", "key")) and not (
            name.endswith("SecretArn") or name == "KmsKeyArn" or name.endswith("KeyPrefix")
        ):
            problems.append(f"parameter {name} looks like a secret value; take a secret's ARN instead")
    return problems


def etcd_user_data(template: Template) -> str:
    """The etcd members' boot script (the launch template's user data, before substitution)."""
    data = template["Resources"]["LaunchTemplate"]["Properties"]["LaunchTemplateData"]
    return str(data["UserData"]["Fn::Base64"]["Fn::Sub"][0])


def etcd_rbac_problems(template: Template) -> list[str]:
    """etcd RBAC: the training user may read and write only TrainingKeyPrefix; root is apart.

    In the boot script: root from its own secret with the root role, the training
    user from its secret with one role, that role granted readwrite on the prefix
    parameter (as a prefix) and nothing else, all before ``auth enable``; and the
    prefix parameter cannot be ``/`` (every key).
    """
    import re

    lines = [line.strip() for line in etcd_user_data(template).replace("\\\n", " ").splitlines()]
    lines = [re.sub(r"\s+", " ", line) for line in lines if line and not line.startswith("#")]

    def at(pattern: str) -> int | None:
        return next((i for i, line in enumerate(lines) if re.search(pattern, line)), None)

    def created_from(user: str, secret: str) -> str | None:
        """A problem unless ``user`` is added with the password the line before read from ``secret``."""
        add = at(rf"\| etcdctl user add {user} --interactive=false$")
        read = at(rf"--secret-id '\$\{{{secret}\}}'")
        if add is None or read is None or not 0 < add - read <= 3 or any(
            "--secret-id" in line for line in lines[read + 1:add]
        ):
            return f"etcd RBAC: user {user} must be added with the password read from {secret}"
        return None

    problems = [p for p in (created_from("root", "EtcdRootPasswordSecretArn"),
                            created_from("training", "EtcdPasswordSecretArn")) if p]
    required = {
        "root has the root role": r"etcdctl user grant-role root root$",
        "a training role exists": r"etcdctl role add training$",
        "the training role may read and write the prefix": (
            r"etcdctl role grant-permission training --prefix=true readwrite '\$\{TrainingKeyPrefix\}'$"),
        "the training user has the training role": r"etcdctl user grant-role training training$",
    }
    enable = at(r"etcdctl auth enable$")
    if enable is None:
        problems.append("etcd RBAC: the boot script never runs 'etcdctl auth enable'")
    for what, pattern in required.items():
        i = at(pattern)
        if i is None:
            problems.append(f"etcd RBAC: {what} (no line matches {pattern!r})")
        elif enable is not None and i > enable:
            problems.append(f"etcd RBAC: {what} only after 'auth enable'")
    for line in lines:
        if "grant-permission" in line and not re.search(required["the training role may read and write the prefix"], line):
            problems.append(f"etcd RBAC: a permission beyond the training prefix: {line!r}")
        m = re.search(r"etcdctl user grant-role (\S+) (\S+)", line)
        if m and m.groups() not in {("root", "root"), ("training", "training")}:
            problems.append(f"etcd RBAC: user {m.group(1)} must have only its own role, not {m.group(2)}")
    pattern = template.get("Parameters", {}).get("TrainingKeyPrefix", {}).get("AllowedPattern")
    if pattern is None or re.fullmatch(pattern, "/") or not re.fullmatch(pattern, "/elastic_ft/"):
        problems.append("TrainingKeyPrefix: its AllowedPattern must refuse '/' (every key) and allow /elastic_ft/")
    return problems


# etcd recommends at most 8 GiB of quota; the history it keeps must also fit the member's data volume.
ETCD_MAX_QUOTA = 8 * 2**30


def _duration_s(text: str) -> float | None:
    """etcd's periodic retention (a Go duration like 5m or 1h30m, or a bare number of hours) in seconds."""
    import re

    if re.fullmatch(r"\d+", text):
        return float(text) * 3600
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|m|s)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def etcd_storage_problems(template: Template) -> list[str]:
    """etcd compacts its history and has a quota that fits the members (see infra/aws/README.md, etcd sizing).

    In the boot script's environment file: ``ETCD_AUTO_COMPACTION_MODE`` periodic or revision with a
    ``ETCD_AUTO_COMPACTION_RETENTION`` of that mode's form (periodic: at most 1 hour, as the sizing
    assumes; revision: a count), and ``ETCD_QUOTA_BACKEND_BYTES`` between etcd's 2 GiB default and its
    8 GiB recommended maximum, and at most half the smallest data volume the template allows (the
    write-ahead log and snapshots share the volume).
    """
    import re

    env = dict(re.findall(r"^\s*(ETCD_[A-Z_]+)=(\S*)\s*$", etcd_user_data(template), re.M))
    problems = []
    mode, retention = env.get("ETCD_AUTO_COMPACTION_MODE"), env.get("ETCD_AUTO_COMPACTION_RETENTION", "")
    if mode not in ("periodic", "revision"):
        problems.append(f"etcd: ETCD_AUTO_COMPACTION_MODE is {mode!r}: set periodic or revision, or the history grows "
                        f"without bound")
    elif mode == "periodic" and not 0 < (_duration_s(retention) or 0) <= 3600:
        problems.append(f"etcd: ETCD_AUTO_COMPACTION_RETENTION {retention!r} must be a duration of at most 1h "
                        f"for periodic compaction")
    elif mode == "revision" and not (retention.isdigit() and int(retention) > 0):
        problems.append(f"etcd: ETCD_AUTO_COMPACTION_RETENTION {retention!r} must be a revision count for revision "
                        f"compaction")
    quota = env.get("ETCD_QUOTA_BACKEND_BYTES", "")
    volume_gib = template["Parameters"]["DataVolumeGiB"].get("MinValue", 0)
    if not quota.isdigit():
        problems.append("etcd: ETCD_QUOTA_BACKEND_BYTES is missing: set a quota sized from the figures")
    elif not 2 * 2**30 <= int(quota) <= ETCD_MAX_QUOTA:
        problems.append(f"etcd: ETCD_QUOTA_BACKEND_BYTES {quota} is outside 2 GiB (etcd's default) to 8 GiB "
                        f"(etcd's recommended maximum)")
    elif int(quota) > volume_gib * 2**30 / 2:
        problems.append(f"etcd: ETCD_QUOTA_BACKEND_BYTES {quota} is over half the smallest data volume "
                        f"(DataVolumeGiB MinValue {volume_gib} GiB)")
    return problems
