"""The ``flashserve`` console script: one subcommand per ``flashserve/*_cmd.py`` module.

A command module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``. Adding a command is adding a module; this file does not
change. Modules import anything heavy inside ``run`` so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
from types import ModuleType

import flashserve


def command_modules() -> list[ModuleType]:
    """Every ``flashserve.*_cmd`` module, in name order."""
    names = sorted(
        info.name
        for info in pkgutil.iter_modules(flashserve.__path__)
        if info.name.endswith("_cmd")
    )
    return [importlib.import_module(f"flashserve.{name}") for name in names]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashserve", description="DeepSeek-V4.1-Flash inference server and tools."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in command_modules():
        sub = commands.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    return int(args.run(args) or 0)
