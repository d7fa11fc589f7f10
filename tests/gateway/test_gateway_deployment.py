"""Deployment TOML -> frozen dataclasses; every error names the file, the key and the value."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from prfaas.cli import engine as engine_cli
from prfaas.cli.engine import transport_tls
from prfaas.cli.main import build_parser
from prfaas.common.toml_tables import ConfigError
from prfaas.engines.transport import TlsConfig
from prfaas.engines.vllm.config import ConnectorConfig
from prfaas.gateway.deployment import load_deployment
from prfaas.serve.vllm_engines import vllm_server

GOOD = """
[model]
name = "tiny"
block_size = 16

[gateway]
policy = "cache-aware"
threshold = 2048
api_keys = ["k1"]

[[instances]]
id = "prfaas-p0"
cluster = "prfaas"
role = "prefill"
url = "http://10.0.0.5:30000"
bootstrap_port = 8998
kv_events = "tcp://10.0.0.5:5557"

[[instances]]
id = "pd-d0"
cluster = "pd"
role = "decode"
url = "http://127.0.0.1:30001"
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "deploy.toml"
    path.write_text(text)
    return path


def test_loads_a_valid_file(tmp_path: Path) -> None:
    """Values land in the dataclasses; lists become tuples; bootstrap host defaults to the
    URL's host."""
    config = load_deployment(_write(tmp_path, GOOD))
    assert config.model.name == "tiny" and config.model.block_size == 16
    assert config.gateway.policy == "cache-aware" and config.gateway.threshold == 2048
    assert config.gateway.api_keys == ("k1",)
    prfaas, decode = config.instances
    assert prfaas.bootstrap_address == "10.0.0.5" and prfaas.bootstrap_port == 8998
    assert decode.role == "decode" and decode.kv_events is None


@pytest.mark.parametrize(
    ("old", "new", "needle"),
    [
        ("block_size = 16", 'block_size = "16"', "model.block_size: must be an integer (got '16')"),
        ("block_size = 16", "block_size = 0", "model.block_size: must be >= 1 (got 0)"),
        ("threshold = 2048", "threshold = -5", "gateway.threshold: must be >= 0 (got -5)"),
        ('policy = "cache-aware"', 'polcy = "x"', "gateway.polcy: unknown key (known: policy, "),
        (
            'role = "decode"',
            'role = "decoder"',
            "instances[1].role: must be one of 'prefill', 'decode', 'both' (got 'decoder')",
        ),
        (
            'url = "http://127.0.0.1:30001"',
            'url = "127.0.0.1:30001"',
            "instances[1].url: must be http(s)://host:port (got '127.0.0.1:30001')",
        ),
        (
            "bootstrap_port = 8998",
            "bootstrap_port = 70000",
            "instances[0].bootstrap_port: must be a port (got 70000)",
        ),
        (
            "bootstrap_port = 8998\n",
            "",
            "instances[0].bootstrap_port: is required for a prefill role",
        ),
        (
            'kv_events = "tcp://10.0.0.5:5557"',
            'kv_events = "x"',
            "instances[0].kv_events: must be a tcp:// or ipc:// endpoint (got 'x')",
        ),
        ('id = "pd-d0"', 'id = "prfaas-p0"', "instances.id: must be unique (got ['prfaas-p0'])"),
        (
            'cluster = "pd"',
            'cluster = "prfaas"',
            "instances: need a decode role in cluster 'pd' (got ['prfaas-p0', 'pd-d0'])",
        ),
        ("threshold = 2048", "threshold = true", "gateway.threshold: must be a number (got True)"),
    ],
)
def test_errors_name_file_key_and_value(tmp_path: Path, old: str, new: str, needle: str) -> None:
    """Each bad value is a ConfigError `FILE: key.path: why (got VALUE)`."""
    assert old in GOOD
    path = _write(tmp_path, GOOD.replace(old, new, 1))
    with pytest.raises(ConfigError) as err:
        load_deployment(path)
    message = str(err.value)
    assert message.startswith(f"{path}: "), message
    assert needle in message, message


def test_bad_toml_missing_file_and_no_instances(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"deploy\.toml"):
        load_deployment(_write(tmp_path, "[model\nname = 1"))
    with pytest.raises(ConfigError, match=r"nope\.toml"):
        load_deployment(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match=r"\[\[instances\]\] or \[\[launch\]\] must list"):
        load_deployment(_write(tmp_path, "[model]\nname = 'x'\n"))
    with pytest.raises(ConfigError, match=r"extra: unknown key \(known: model, gateway, "):
        load_deployment(_write(tmp_path, GOOD + "\n[extra]\na = 1\n"))


def test_launch_entries(tmp_path: Path) -> None:
    """`[[launch]]` engines count toward the deployment (a launched decode suffices) and are
    validated like instances."""
    text = '[[launch]]\nid = "pd-d0"\ncluster = "pd"\nrole = "decode"\nthreads = 2\n'
    config = load_deployment(_write(tmp_path, text))
    assert config.instances == () and config.launch[0].threads == 2
    with pytest.raises(ConfigError, match=r"launch\[0\]\.threads: must be >= 1 \(got 0\)"):
        load_deployment(_write(tmp_path, text.replace("threads = 2", "threads = 0")))
    with pytest.raises(ConfigError, match="unique"):
        load_deployment(_write(tmp_path, text + text))


def test_launch_link_emulation(tmp_path: Path) -> None:
    """A launched prefill engine can pace its KV egress (the emulated cross-DC link): the
    fields become `prfaas engine` flags; a decode has no egress to pace; bad values name
    the key."""
    text = (
        '[[launch]]\nid = "pf-0"\ncluster = "prfaas"\nrole = "prefill"\n'
        "egress_rate_mbps = 25\negress_delay_ms = 5\n"
        '[[launch]]\nid = "pd-d0"\ncluster = "pd"\nrole = "decode"\n'
    )
    config = load_deployment(_write(tmp_path, text))
    prefill, decode = config.launch
    assert prefill.engine_args() == ("--egress-rate-mbps", "25", "--egress-delay-ms", "5")
    assert decode.engine_args() == ()
    with pytest.raises(ConfigError, match=r"launch\[0\]\.egress_rate_mbps: must be > 0 \(got -1\)"):
        load_deployment(_write(tmp_path, text.replace("= 25", "= -1")))
    paced_decode = text.replace('role = "decode"\n', 'role = "decode"\negress_delay_ms = 3\n')
    with pytest.raises(ConfigError, match=r"launch\[1\]\.role: has no KV egress to pace"):
        load_deployment(_write(tmp_path, paced_decode))


def test_launch_device(tmp_path: Path) -> None:
    """A launched reference engine runs on the device (and dtype) its entry names, passed
    as `prfaas engine` flags that the engine's own parser takes; the CPU default adds no
    flag; a malformed device, an unknown dtype, or a device on a vLLM engine is refused,
    named."""
    base = '[[launch]]\nid = "pd-0"\ncluster = "pd"\nrole = "both"\n'
    assert load_deployment(_write(tmp_path, base)).launch[0].engine_args() == ()
    gpu = load_deployment(_write(tmp_path, base + 'device = "cuda:1"\ndtype = "float16"\n'))
    args = gpu.launch[0].engine_args()
    assert args == ("--device", "cuda:1", "--dtype", "float16")
    parser = argparse.ArgumentParser()
    engine_cli.add_arguments(parser)
    parsed = parser.parse_args(list(args))
    assert (parsed.device, parsed.dtype) == ("cuda:1", "float16")
    for bad, key in (('device = "gpu0"', "device"), ('dtype = "int8"', "dtype")):
        with pytest.raises(ConfigError, match=rf"launch\[0\]\.{key}: must be"):
            load_deployment(_write(tmp_path, base + bad + "\n"))
    vllm = base + 'engine = "vllm"\ndevice = "cuda"\n'
    with pytest.raises(ConfigError, match=r"launch\[0\]\.device: is for reference engines"):
        load_deployment(_write(tmp_path, vllm))


def test_launch_kv_sender(tmp_path: Path) -> None:
    """`kv_sender = "process"` runs a launched engine's KV sender in a process of its own: a
    flag a reference engine's parser takes, a vLLM engine's connector setting; another
    value is refused."""
    base = '[[launch]]\nid = "pd-0"\ncluster = "pd"\nrole = "both"\n'
    launched = load_deployment(_write(tmp_path, base + 'kv_sender = "process"\n')).launch[0]
    parser = argparse.ArgumentParser()
    engine_cli.add_arguments(parser)
    assert parser.parse_args(list(launched.engine_args())).kv_sender == "process"
    with pytest.raises(ConfigError, match=r"launch\[0\]\.kv_sender: must be loop or process"):
        load_deployment(_write(tmp_path, base + 'kv_sender = "thread"\n'))
    vllm = f'engine = "vllm"\nkv_sender = "process"\npython = "{sys.executable}"\n'
    config = load_deployment(_write(tmp_path, base + vllm))
    server = vllm_server(config.launch[0], config.model, 9000, "ipc:///tmp/none")
    assert server.connector is not None  # a vLLM engine's: its connector's setting
    assert ConnectorConfig.from_extra(server.connector).sender_process


def test_engine_kind_per_instance_defaults_to_reference(tmp_path: Path) -> None:
    """`engine = "vllm"` selects vLLM's protocol for an instance or a launched engine;
    without it an instance is a reference engine; another kind is an error naming it, and
    an SGLang server is listed, never launched."""
    text = GOOD.replace('role = "prefill"', 'role = "prefill"\nengine = "vllm"')
    text += '[[launch]]\nid = "v"\ncluster = "pd"\nrole = "decode"\nengine = "vllm"\n'
    config = load_deployment(_write(tmp_path, text))
    assert [i.engine for i in config.instances] == ["vllm", "reference"]
    assert config.launch[0].engine == "vllm"
    assert config.launch[0].python == ".venv-vllm/bin/python"
    bad = GOOD.replace('role = "decode"', 'role = "decode"\nengine = "trt"')
    with pytest.raises(ConfigError, match=r"instances\[1\]\.engine: must be one of"):
        load_deployment(_write(tmp_path, bad))
    listed = GOOD.replace('role = "decode"', 'role = "decode"\nengine = "sglang"')
    assert load_deployment(_write(tmp_path, listed)).instances[1].engine == "sglang"
    launched = text.replace('engine = "vllm"\n', 'engine = "sglang"\n')
    with pytest.raises(ConfigError, match=r"launch\[0\]\.engine: must be one of"):
        load_deployment(_write(tmp_path, launched))


def test_launch_vllm_standby_is_for_vllm_engines(tmp_path: Path) -> None:
    """`vllm_standby` (a vLLM engine's next start spawned ahead of need) is unset (on) by
    default, may be turned off, and is refused, named, on a reference engine."""
    text = '[[launch]]\nid = "v"\ncluster = "pd"\nrole = "decode"\nengine = "vllm"\n'
    assert load_deployment(_write(tmp_path, text)).launch[0].vllm_standby is None
    off = load_deployment(_write(tmp_path, text + "vllm_standby = false\n"))
    assert off.launch[0].vllm_standby is False
    reference = text.replace('engine = "vllm"\n', "vllm_standby = true\n")
    with pytest.raises(ConfigError, match=r"launch\[0\]\.vllm_standby: is for vLLM engines"):
        load_deployment(_write(tmp_path, reference))


def test_launch_vllm_pages_in_the_models_block_size(tmp_path: Path) -> None:
    """A launched vLLM engine pages in `[model] block_size` (the KV index's), so a
    `--block-size` of its own among `vllm_args` is refused, named, in any spelling vLLM
    reads."""
    text = '[[launch]]\nid = "v"\ncluster = "pd"\nrole = "decode"\nengine = "vllm"\n'
    for flag in ('["--block-size", "16"]', '["--block-size=16"]', '["--block_size", "16"]'):
        with pytest.raises(ConfigError, match=r"launch\[0\]\.vllm_args: must not set --block-size"):
            load_deployment(_write(tmp_path, text + f"vllm_args = {flag}\n"))
    sized = text + 'vllm_args = ["--max-num-seqs", "4"]\n'
    assert load_deployment(_write(tmp_path, sized)).launch[0].vllm_args[0] == "--max-num-seqs"


def test_launch_transport_tls(tmp_path: Path) -> None:
    """`transport_tls_*` fields of launched reference engines: paths relative to the file
    become absolute `prfaas engine` flags, which parse back into the engine's `TlsConfig`;
    the three files go together and must be readable (errors name the key and the file);
    a deployment turns TLS on for every launched reference engine or for none (a TLS decode
    fetches every prefill over TLS); vLLM engines have no TLS settings here."""
    (tmp_path / "certs").mkdir()
    for name in ("p.pem", "p.key", "d.pem", "d.key", "ca.pem"):
        (tmp_path / "certs" / name).write_text("PEM\n")

    def launch(id_: str, role: str, cert: str | None, verify: bool = False) -> str:
        text = f'[[launch]]\nid = "{id_}"\ncluster = "pd"\nrole = "{role}"\n'
        if cert is not None:
            text += (f'transport_tls_cert = "certs/{cert}.pem"\n'
                     f'transport_tls_key = "certs/{cert}.key"\n'
                     'transport_tls_ca = "certs/ca.pem"\n')  # fmt: skip
        return text + ("transport_tls_verify_client = true\n" if verify else "")

    text = launch("p", "prefill", "p", verify=True) + launch("d", "decode", "d")
    prefill, decode = load_deployment(_write(tmp_path, text)).launch
    certs = tmp_path / "certs"
    assert prefill.engine_args() == (
        "--transport-tls-cert", str(certs / "p.pem"), "--transport-tls-key", str(certs / "p.key"),
        "--transport-tls-ca", str(certs / "ca.pem"), "--transport-tls-verify-client",
    )  # fmt: skip
    args = build_parser().parse_args(["engine", *prefill.engine_args()])
    assert transport_tls(args) == TlsConfig(
        certs / "p.pem", certs / "p.key", certs / "ca.pem", verify_client=True
    )
    assert decode.transport_tls and "--transport-tls-verify-client" not in decode.engine_args()

    partial = text.replace('transport_tls_key = "certs/d.key"\n', "")
    match = r"launch\[1\]\.transport_tls_key: is required with transport_tls_cert, transport_tls_ca"
    with pytest.raises(ConfigError, match=match):
        load_deployment(_write(tmp_path, partial))
    (certs / "ca.pem").unlink()
    with pytest.raises(
        ConfigError, match=r"launch\[0\]\.transport_tls_ca: cannot read '.*certs/ca"
    ):
        load_deployment(_write(tmp_path, text))
    (certs / "ca.pem").write_text("PEM\n")
    mixed = launch("p", "prefill", "p") + launch("d", "decode", None) + launch("e", "decode", None)
    with pytest.raises(ConfigError, match=r"launch: lack the transport TLS .* \(got \['d', 'e'\]"):
        load_deployment(_write(tmp_path, mixed))
    vllm = text.replace('role = "decode"\n', 'role = "decode"\nengine = "vllm"\n')
    with pytest.raises(ConfigError, match=r"launch\[1\]\.engine: has no transport TLS settings"):
        load_deployment(_write(tmp_path, vllm))
    loose = launch("d", "decode", None, verify=True)
    with pytest.raises(ConfigError, match=r"launch\[0\]\.transport_tls_verify_client: needs"):
        load_deployment(_write(tmp_path, loose))
