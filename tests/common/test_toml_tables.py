"""The TOML table -> frozen dataclass builder: values land typed (arrays as tuples, ints
widened to floats), and every bad key or value is one ConfigError naming the file, the key
path and the value as the file wrote it."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from prfaas.common.toml_tables import ConfigError, FieldError, build, check, load_toml


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __post_init__(self) -> None:
        check(0 < self.port < 65536, "port", self.port, "must be a port")


@dataclass(frozen=True)
class Server:
    name: str
    weight: float = 1.0
    tls: bool = False
    mode: Literal["fast", "safe"] = "safe"
    tags: tuple[str, ...] = ()
    listen: Endpoint | None = None
    backends: tuple[Endpoint, ...] = ()
    limits: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check(self.weight > 0, "weight", self.weight, "must be > 0")
        check(len(set(self.tags)) == len(self.tags), "tags", self.tags, "must be unique")


GOOD = """
name = "front"
weight = 2
tls = true
mode = "fast"
tags = ["a", "b"]
listen = { host = "0.0.0.0", port = 80 }
limits = { rps = 10 }

[[backends]]
host = "10.0.0.1"
port = 8000

[[backends]]
host = "10.0.0.2"
port = 8001
"""
NAMED = 'name = "x"\n'  # the one required key, before the line under test


def _error(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        build(Server, tomllib.loads(text), source="cfg.toml")
    return str(info.value)


def test_builds_typed_values_and_defaults() -> None:
    """Arrays become tuples, arrays of tables tuples of dataclasses, an int in a float field
    a float; absent keys take their defaults."""
    server = build(Server, tomllib.loads(GOOD), source="cfg.toml")
    assert server == Server(
        name="front",
        weight=2.0,
        tls=True,
        mode="fast",
        tags=("a", "b"),
        listen=Endpoint("0.0.0.0", 80),
        backends=(Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8001)),
        limits={"rps": 10},
    )
    assert type(server.weight) is float
    assert build(Server, {"name": "x"}, source="cfg.toml") == Server(name="x")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (NAMED + 'nmae = "y"', "cfg.toml: nmae: unknown key (known: name, weight, tls, "),
        (
            NAMED + 'listen = { host = "h", prot = 1 }',
            "listen.prot: unknown key (known: host, port)",
        ),
        (
            NAMED + '[[backends]]\nhost = "h"\nport = 1\nextra = 2',
            "backends[0].extra: unknown key",
        ),
    ],
)
def test_unknown_key_names_its_path(text: str, message: str) -> None:
    """A key the dataclass lacks is an error at any depth (a typo never passes silently)."""
    assert message in _error(text)


def test_missing_required_key_names_its_path() -> None:
    """A field without a default must be present; the message has no value to show."""
    assert _error("weight = 1") == "cfg.toml: name: is required"
    text = NAMED + '[[backends]]\nhost = "h"\nport = 1\n[[backends]]\nhost = "h"'
    assert _error(text) == "cfg.toml: backends[1].port: is required"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name = 3", "name: must be a string (got 3)"),
        (NAMED + 'weight = "heavy"', "weight: must be a number (got 'heavy')"),
        (NAMED + "tls = 1", "tls: must be a boolean (got 1)"),
        (NAMED + 'mode = "quick"', "mode: must be one of 'fast', 'safe' (got 'quick')"),
        (NAMED + 'tags = "a"', "tags: must be an array (got 'a')"),
        (NAMED + 'tags = ["a", 1]', "tags[1]: must be a string (got 1)"),
        (NAMED + "listen = 3", "listen: must be a table (got 3)"),
        (
            NAMED + 'listen = { host = "h", port = 8.0 }',
            "listen.port: must be an integer (got 8.0)",
        ),
        (NAMED + 'limits = { rps = "x" }', "limits.rps: must be an integer (got 'x')"),
    ],
)
def test_wrong_type_names_key_and_value(text: str, message: str) -> None:
    """Each value must fit its field's type hint; the message names key path and value."""
    assert _error(text) == f"cfg.toml: {message}"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('listen = { host = "h", port = true }', "listen.port: must be an integer (got True)"),
        ("weight = true", "weight: must be a number (got True)"),
        ("limits = { rps = false }", "limits.rps: must be an integer (got False)"),
    ],
)
def test_bool_is_not_a_number(line: str, message: str) -> None:
    """TOML booleans are Python ints; they are still refused where a number is expected."""
    assert _error(NAMED + line) == f"cfg.toml: {message}"


def test_post_init_errors_get_the_table_path_and_the_written_value() -> None:
    """A dataclass's own check is reported under its table's path, with the value as the
    file wrote it (an array, not the tuple it became; `-1`, not `-1.0`)."""
    bad_port = GOOD.replace("port = 8001", "port = 70000")
    assert _error(bad_port) == "cfg.toml: backends[1].port: must be a port (got 70000)"
    assert _error(NAMED + "weight = -1") == "cfg.toml: weight: must be > 0 (got -1)"
    assert _error(NAMED + 'tags = ["a", "a"]') == "cfg.toml: tags: must be unique (got ['a', 'a'])"


def test_direct_construction_raises_field_error() -> None:
    """Code building a config directly gets the same check as a ValueError naming the field."""
    with pytest.raises(FieldError, match=r"^port: must be a port \(got 0\)$") as info:
        Endpoint("h", 0)
    assert isinstance(info.value, ValueError)
    assert (info.value.key, info.value.value) == ("port", 0)


def test_load_toml_names_the_file(tmp_path: Path) -> None:
    """An unreadable file and a syntax error are ConfigErrors naming the file."""
    with pytest.raises(ConfigError, match=r"nope\.toml: cannot read: "):
        load_toml(tmp_path / "nope.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[server\nname = 1")
    with pytest.raises(ConfigError, match=r"broken\.toml: invalid TOML: "):
        load_toml(broken)
    good = tmp_path / "good.toml"
    good.write_text(GOOD)
    assert build(Server, load_toml(good), source=str(good)).backends[1].port == 8001
