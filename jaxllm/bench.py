"""`jaxllm bench`: engine speed on this machine (filled in below)."""

from __future__ import annotations

import argparse


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="engine benchmark")
    p.set_defaults(func=lambda args: 0)
