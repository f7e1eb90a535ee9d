"""The job spec's checkpoint.s3 section reaches the store the trainer opens: the real trainer
(one process) saving to a real S3 server (moto, which records SSE headers; SeaweedFS has no KMS)."""

from __future__ import annotations

from elastic_ft import worker
from tests.conftest import DEFAULT_SPEC


def test_spec_sse_kms_is_sent_on_every_object_and_wins_over_the_environment(s3_env, s3_servers, monkeypatch,
                                                                           tmp_path):
    endpoint = s3_servers.get("moto")
    s3_env(endpoint)
    monkeypatch.setenv("ELASTIC_FT_S3_SSE", "AES256")  # the spec's setting wins over this
    base = f"s3://{endpoint.bucket}/spec-sse/{tmp_path.name}"
    args = ["--spec", DEFAULT_SPEC, "--run_id", "run", "--checkpoint_uri", base, "--log_dir", str(tmp_path / "logs"),
            "steps=2", "checkpoint.every_steps=2", "checkpoint.s3.sse=aws:kms",
            "checkpoint.s3.sse_kms_key_id=alias/ckpt-from-spec", "checkpoint.s3.max_attempts=3"]
    assert worker.main(args) == 0
    client = endpoint.client()
    listed = client.list_objects_v2(Bucket=endpoint.bucket, Prefix=f"spec-sse/{tmp_path.name}/run/")
    keys = [o["Key"] for o in listed.get("Contents", [])]
    assert any(k.endswith(".json") and "/manifests/" in k for k in keys), keys
    assert any("/blobs/" in k for k in keys), keys
    for key in keys:
        head = client.head_object(Bucket=endpoint.bucket, Key=key)
        assert (head.get("ServerSideEncryption"), head.get("SSEKMSKeyId")) == ("aws:kms", "alias/ckpt-from-spec"), key


def test_a_bad_spec_s3_setting_stops_before_any_work_naming_the_field(s3_env, s3_servers, tmp_path, capsys):
    endpoint = s3_servers.get("moto")
    s3_env(endpoint)
    base = f"s3://{endpoint.bucket}/spec-bad/{tmp_path.name}"
    args = ["--spec", DEFAULT_SPEC, "--run_id", "run", "--checkpoint_uri", base, "--log_dir", str(tmp_path / "logs"),
            "steps=2", "checkpoint.s3.sse=AES256", "checkpoint.s3.sse_kms_key_id=alias/k"]
    assert worker.main(args) == 2
    err = capsys.readouterr().err
    assert "checkpoint.s3.sse_kms_key_id: S3 server-side encryption 'AES256' takes no KMS key id" in err, err
    assert "Traceback" not in err
    listed = endpoint.client().list_objects_v2(Bucket=endpoint.bucket, Prefix=f"spec-bad/{tmp_path.name}/")
    assert listed.get("KeyCount", 0) == 0
