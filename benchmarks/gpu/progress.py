"""What a GPU campaign stage leaves behind as it goes: progress lines (a stage cut short by
its time limit shows how far it got) and its JSON, written whole or not at all (the campaign
may stop a stage mid-write and keeps what the file held)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

_STARTED = time.monotonic()


def say(stage: str, what: str) -> None:
    """A progress line, with the seconds since this process started."""
    print(f"[{stage} {time.monotonic() - _STARTED:7.1f} s] {what}", flush=True)


def write_json(path: Path, report: dict[str, Any]) -> None:
    """`report` into `path` atomically."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(report, indent=2))
    partial.replace(path)
