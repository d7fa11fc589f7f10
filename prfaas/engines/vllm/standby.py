"""A vLLM OpenAI server started ahead of need, for the next restart of an engine.

`python -m prfaas.engines.vllm.standby ARGS...` (the vLLM environment's interpreter, the
environment the server will have) imports vLLM's API server, then waits for one line on
stdin: `go ROLE` serves with ARGS (the `vllm.entrypoints.openai.api_server` flags) in ROLE
(`PRFAAS_ROLE`, read when the server starts: a standby spawned before its engine was
converted starts in the new role; a ROLE that is none exits 2), `go` alone in the role of
its environment; anything else or end of input exits 0. The import is a third to a half of
a vLLM start on CPU (10 of 23 s on an idle 2-core machine, more under load: it is
single-threaded Python), so a supervisor that keeps one standby per engine brings a dead
engine back that much sooner (`prfaas.serve.vllm_engines.VLLMRestarts`). vLLM's EngineCore
process is spawned after `go`, as at any start, and imports vLLM afresh.

`main` runs only as `__main__`: vLLM spawns its EngineCore with the `spawn` start method,
which imports this module again in the child, where nothing must run.
"""

from __future__ import annotations

import os
import sys

GO = "go"
READY = "prfaas standby: vLLM imported, waiting"
"""What the standby writes to stderr once vLLM is imported."""


def main() -> int:
    from vllm.entrypoints.launchers.api_server import entry  # the slow part: vLLM, torch

    from prfaas.engines.vllm import auth, role  # noqa: F401  (the middlewares vLLM loads)

    print(READY, file=sys.stderr, flush=True)
    command = sys.stdin.readline().split()
    if command[:1] != [GO]:
        return 0
    if len(command) > 1:
        if command[1] not in role.ROLES:  # exit at once: the supervisor then starts afresh
            print(f"prfaas standby: no role {command[1]!r}", file=sys.stderr, flush=True)
            return 2
        os.environ[role.ENV_ROLE] = command[1]
    sys.argv = ["vllm.entrypoints.openai.api_server", *sys.argv[1:]]
    entry.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
