"""`[coordination]` (`CoordinationConfig`): every rule it enforces refuses a bad value with
an error naming the file, the field and the value, and good values read as written."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from prfaas.common.toml_tables import ConfigError, FieldError
from prfaas.coordination.config import CoordinationConfig
from prfaas.gateway.deployment import load_deployment

DEPLOYMENT = """
[model]
name = "tiny"

[[instances]]
id = "pd-d0"
cluster = "pd"
role = "decode"
url = "http://127.0.0.1:30001"

[coordination]
"""


def _load(tmp_path: Path, table: str) -> CoordinationConfig:
    path = tmp_path / "deploy.toml"
    path.write_text(DEPLOYMENT + table)
    config = load_deployment(path).coordination
    assert config is not None
    return config


def test_defaults_and_endpoints(tmp_path: Path) -> None:
    """An empty table is the documented defaults; `etcd` may list several URLs
    (comma-separated, spaces and trailing slashes dropped)."""
    assert _load(tmp_path, "") == CoordinationConfig(
        "http://127.0.0.1:2379", "/prfaas/default", 2.0, 0.5
    )
    config = _load(
        tmp_path,
        'etcd = "http://10.0.0.1:2379/, https://etcd.example ,http://[::1]:2379"\n'
        'prefix = "/prfaas/prod-eu"\nlease_ttl_s = 1\npublish_s = 0.25\n',
    )
    assert config.endpoints == ("http://10.0.0.1:2379", "https://etcd.example", "http://[::1]:2379")
    assert (config.prefix, config.lease_ttl_s, config.publish_s) == ("/prfaas/prod-eu", 1.0, 0.25)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        # etcd: http(s) URLs with a host, comma-separated
        ('etcd = "127.0.0.1:2379"', "coordination.etcd: must be http(s)://HOST[:PORT] URLs"),
        ('etcd = "grpc://127.0.0.1:2379"', "coordination.etcd: must be http(s)://HOST"),
        ('etcd = "http://"', "coordination.etcd: must be http(s)://HOST"),
        ('etcd = "http:/etcd"', "coordination.etcd: must be http(s)://HOST"),
        ('etcd = "http://etcd:port"', "coordination.etcd: must be http(s)://HOST"),
        ('etcd = "http://etcd:70000"', "coordination.etcd: must be http(s)://HOST"),
        ('etcd = "http://etcd:0"', "coordination.etcd: must be http(s)://HOST"),
        ('etcd = "http://etcd:2379/v3"', "coordination.etcd: must be http(s)://HOST"),
        ('etcd = "http://etcd:2379?x=1"', "coordination.etcd: must be http(s)://HOST"),
        ('etcd = "http://a:2379,ftp://b"', "coordination.etcd: must be http(s)://HOST"),
        ('etcd = ""', "coordination.etcd: must be http(s)://HOST"),
        ('etcd = " , "', "coordination.etcd: must be http(s)://HOST"),
        ("etcd = 2379", "coordination.etcd: must be a string (got 2379)"),
        # prefix: one absolute key path, no trailing slash
        ('prefix = "prfaas"', "coordination.prefix: must start with / and not end with /"),
        ('prefix = "/prfaas/"', "coordination.prefix: must start with / and not end with /"),
        ('prefix = "/"', "coordination.prefix: must start with / and not end with /"),
        ('prefix = ""', "coordination.prefix: must start with / and not end with /"),
        # lease_ttl_s: etcd's leases are whole seconds, at least one; finite
        ("lease_ttl_s = 0.5\npublish_s = 0.25", "coordination.lease_ttl_s: must be >= 1"),
        ("lease_ttl_s = 0", "coordination.lease_ttl_s: must be >= 1"),
        ("lease_ttl_s = -2", "coordination.lease_ttl_s: must be >= 1"),
        ("lease_ttl_s = inf", "coordination.lease_ttl_s: must be >= 1 (etcd's unit) and finite"),
        ("lease_ttl_s = nan", "coordination.lease_ttl_s: must be >= 1"),
        ('lease_ttl_s = "2"', "coordination.lease_ttl_s: must be a number"),
        # publish_s: positive, and more often than a lease expires
        ("publish_s = 0", "coordination.publish_s: must be > 0 and < lease_ttl_s (got 0)"),
        ("publish_s = -0.5", "coordination.publish_s: must be > 0 and < lease_ttl_s"),
        ("publish_s = 2.0", "coordination.publish_s: must be > 0 and < lease_ttl_s (got 2.0)"),
        ("lease_ttl_s = 3\npublish_s = 5", "coordination.publish_s: must be > 0 and < lease_ttl_s"),
        ("publish_s = nan", "coordination.publish_s: must be > 0 and < lease_ttl_s"),
        # a typo is an error, not a default
        ("lease_ttl = 5", "coordination.lease_ttl: unknown key (known: etcd, prefix, lease_ttl_s"),
    ],
)
def test_each_rule_refuses_naming_file_field_and_value(
    tmp_path: Path, table: str, message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, table + "\n")
    text = str(err.value)
    assert text.startswith(f"{tmp_path / 'deploy.toml'}: "), text
    assert message in text, text


def test_built_in_code_the_error_names_the_field() -> None:
    """Built directly (not from a file), a bad value raises `FieldError` for that field."""
    cases = {
        "etcd": {"etcd": "localhost:2379"},
        "prefix": {"prefix": "/x/"},
        "lease_ttl_s": {"lease_ttl_s": math.inf},
        "publish_s": {"publish_s": 2.0},
    }
    for field, kwargs in cases.items():
        with pytest.raises(FieldError) as err:
            CoordinationConfig(**kwargs)  # type: ignore[arg-type]
        assert err.value.key == field
