"""The ``epcomm`` console script: ``epcomm bench ...``, ``epcomm plan ...`` and ``epcomm doctor ...``.

Each subcommand's module is imported only when it is used, so ``epcomm plan`` does not pay for
the benchmark's imports and a missing optional part breaks only its own subcommand.
"""

from __future__ import annotations

import sys

USAGE = """usage: epcomm <command> [options]

commands:
  bench   measure dispatch/combine against all_to_all_single (python -m epcomm.bench)
  plan    plan buffer sizes and settings for a deployment (epcomm.planner)
  doctor  check this machine before a job: GPUs, peer access, compiler, NVSHMEM, NICs, variables

'epcomm <command> --help' describes a command's options."""


def _bench(argv: list[str]) -> int | None:
    from .bench.driver import main as bench_main

    return bench_main(argv)


def _plan(argv: list[str]) -> int | None:
    try:
        from .planner.cli import main as plan_main
    except ImportError as error:
        print(f"epcomm plan: the planner is not available in this installation ({error})", file=sys.stderr)
        return 1
    return plan_main(argv)


def _doctor(argv: list[str]) -> int | None:
    from .doctor import main as doctor_main

    return doctor_main(argv)


COMMANDS = {"bench": _bench, "plan": _plan, "doctor": _doctor}


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a subcommand; returns its exit status (2 for an unknown command)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] == "--version":
        from . import __version__

        print(f"epcomm {__version__}")
        return 0
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"{USAGE}\n\nepcomm: error: unknown command {args[0]!r} (choose from {', '.join(COMMANDS)})",
              file=sys.stderr)
        return 2
    status = command(args[1:])
    return 0 if status is None else int(status)


if __name__ == "__main__":
    sys.exit(main())
