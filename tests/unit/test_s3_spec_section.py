"""The job spec's checkpoint.s3 section (the S3 store's settings): bounds and rules name the field,
and explicit settings win over the environment, which wins over the defaults."""

import re

import pytest

from elastic_ft.checkpoint.s3.options import ENV_SSE, ENV_SSE_KMS_KEY_ID, S3Options
from elastic_ft.config import ConfigError, spec_from_dict

MiB = 1 << 20
BASE = {"model": {"config": {"model_type": "llama"}}, "data": {"files": ["s3://b/data.jsonl"]}, "steps": 3}


def problems(*overrides: str) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        spec_from_dict(BASE, overrides=overrides)
    return info.value.problems


def test_spec_sets_every_s3_setting():
    spec = spec_from_dict(BASE, overrides=[
        "checkpoint.s3.sse=aws:kms", "checkpoint.s3.sse_kms_key_id=alias/ckpt", "checkpoint.s3.max_concurrency=4",
        f"checkpoint.s3.part_size={16 * MiB}", f"checkpoint.s3.multipart_threshold={32 * MiB}",
        "checkpoint.s3.max_attempts=9", "checkpoint.s3.read_timeout=120", "checkpoint.s3.region=eu-west-1",
    ])
    assert spec.checkpoint.s3 == S3Options(
        sse="aws:kms", sse_kms_key_id="alias/ckpt", max_concurrency=4, part_size=16 * MiB,
        multipart_threshold=32 * MiB, max_attempts=9, read_timeout=120.0, region="eu-west-1",
    )
    assert spec.checkpoint.store_settings() == {"s3": {"options": spec.checkpoint.s3}}
    assert spec_from_dict(BASE).checkpoint.s3 == S3Options()  # nothing set: the store's defaults


@pytest.mark.parametrize(
    ("override", "field", "match"),
    [
        ("checkpoint.s3.sse=aes256", "checkpoint.s3.sse", "'aes256' is not one of 'AES256', 'aws:kms', 'none'"),
        ("checkpoint.s3.part_size=1024", "checkpoint.s3.part_size", r"must be in \[5242880, "),
        ("checkpoint.s3.max_concurrency=0", "checkpoint.s3.max_concurrency", r"must be in \[1, 64\], got 0"),
        ("checkpoint.s3.max_attempts=1000", "checkpoint.s3.max_attempts", r"must be in \[1, 100\]"),
        ("checkpoint.s3.read_timeout=-1", "checkpoint.s3.read_timeout", r"must be in \(0.0, 3600.0\]"),
        ("checkpoint.s3.sse_kms_key_id=[1]", "checkpoint.s3.sse_kms_key_id", "must be str"),
        (f"checkpoint.s3.part_size={16 * MiB}", "checkpoint.s3.multipart_threshold",
         r"threshold \(8388608\) must be at least the part size \(16777216\)"),
        ("checkpoint.s3.backoff_initial=20", "checkpoint.s3.backoff_initial", r"must satisfy 0 < initial <= max"),
        ("checkpoint.s3.access_key_id=AKIA", "checkpoint.s3.access_key_id", "unknown key"),
    ],
)
def test_a_bad_s3_setting_is_one_problem_naming_its_field(override, field, match):
    found = problems(override)
    assert [f for f, _ in found] == [field], found
    assert re.search(match, found[0][1]), found


@pytest.mark.parametrize(
    ("overrides", "field", "match"),
    [
        (["checkpoint.s3.sse=AES256", "checkpoint.s3.sse_kms_key_id=alias/k"], "checkpoint.s3.sse_kms_key_id",
         "'AES256' takes no KMS key id"),
        (["checkpoint.s3.sse=none", "checkpoint.s3.sse_kms_key_id=alias/k"], "checkpoint.s3.sse_kms_key_id",
         "is 'none' but a KMS key id"),
    ],
)
def test_sse_pair_rules_name_the_key_field(overrides, field, match):
    found = problems(*overrides)
    assert [f for f, _ in found] == [field] and match in found[0][1], found


def test_explicit_settings_win_over_the_environment_which_wins_over_defaults():
    env = {ENV_SSE: "AES256", ENV_SSE_KMS_KEY_ID: ""}
    assert S3Options.resolve({"sse": "aws:kms"}, environ=env).sse_args == {"ServerSideEncryption": "aws:kms"}
    assert S3Options.resolve({}, environ=env).sse_args == {"ServerSideEncryption": "AES256"}
    assert S3Options.resolve({"sse": None}, environ=env).sse == "AES256"  # null in a spec is "not set"
    assert S3Options.resolve({}, environ={}).sse_args == {}
    only_key = S3Options.resolve({}, environ={ENV_SSE_KMS_KEY_ID: "alias/env"})
    assert only_key.sse_args == {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "alias/env"}
    assert S3Options.resolve({"max_concurrency": 3}, environ={}).max_concurrency == 3
    assert S3Options.resolve({}, environ={}).max_concurrency >= 1  # the CPU-based default, resolved


def test_open_store_passes_only_the_uris_own_schemes_settings(tmp_path, monkeypatch):
    from elastic_ft.checkpoint.local import LocalStore
    from elastic_ft.checkpoint.s3 import S3Store
    from elastic_ft.checkpoint.store import open_store

    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")  # a client is built, nothing is sent
    monkeypatch.delenv(ENV_SSE, raising=False)
    monkeypatch.delenv(ENV_SSE_KMS_KEY_ID, raising=False)
    settings = spec_from_dict(BASE, overrides=["checkpoint.s3.max_concurrency=3", "checkpoint.s3.sse=AES256"])
    s3 = open_store("s3://bucket/runs", settings.checkpoint.store_settings())
    try:
        assert type(s3) is S3Store
        assert s3.max_concurrency == 3 and s3.sse_args == {"ServerSideEncryption": "AES256"}
    finally:
        s3.close()
    assert type(open_store(str(tmp_path), settings.checkpoint.store_settings())) is LocalStore
