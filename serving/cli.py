"""The `jaxllm` command: the runtime's subcommands plus `serve` (which needs this package)."""

from __future__ import annotations

import sys

from jaxllm import cli as runtime_cli


def main(argv: list[str] | None = None) -> int:
    parser = runtime_cli.build_parser()
    return runtime_cli.main(argv, parser)


if __name__ == "__main__":
    sys.exit(main())
