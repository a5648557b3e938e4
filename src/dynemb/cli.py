"""The ``dynemb`` command."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _tour(args: argparse.Namespace) -> int:
    from .tour import run_tour

    run_tour()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dynemb", description="Dynamic embedding tables for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the main demo on embedded defaults")
    demo.set_defaults(func=_tour)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
