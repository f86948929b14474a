"""`python -m vsurge.router ...`: the same as `vsurge route ...`."""

from __future__ import annotations

import argparse
import sys

from .cli import HELP, add_route_arguments, run_route


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vsurge route", description=HELP)
    add_route_arguments(parser)
    return run_route(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
