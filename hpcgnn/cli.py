"""The `hpcgnn` command: one entry point, one module per subcommand.

Each subcommand lives in ``hpcgnn/commands/<name>.py`` and provides
``add_arguments(parser)``, ``run(args) -> int`` and ``EXAMPLES`` (the text that ends its
``--help``). Modules are imported only
when their subcommand runs, so `hpcgnn inspect` does not pay for torch.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from hpcgnn import log
from hpcgnn.errors import EXIT_INPUT, InputError

SUBCOMMANDS = {
    "prepare": "write one canonical HDF5 graph file from a dataset or a generator",
    "partition": "partition a graph file into an HDF5 partition store",
    "inspect": "summarise a graph file or a partition directory",
    "train": "train a GNN on a partition store (run under mpiexec/srun)",
    "report": "summarise a run directory",
    "plan": "predict memory and epoch time of every engine setting; recommend one",
    "infer": "write every vertex's logits, predictions or embeddings from a checkpoint (collective)",
    "config": "list every configuration key: type, default, allowed values, engines, help",
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line with exit code 2."""

    def error(self, message):  # noqa: D401 - argparse hook
        raise InputError(f"{self.prog}: {message}")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (all of them when None)."""
    parser = _Parser(prog="hpcgnn", description=__doc__.splitlines()[0])
    from hpcgnn import __version__

    parser.add_argument("--version", action="version", version=f"hpcgnn {__version__}")
    talk = parser.add_mutually_exclusive_group()
    talk.add_argument("-v", "--verbose", action="count", default=0,
                      help="say more: train prints each epoch's phase times under its line, and "
                           "train/infer name the backend that carries the data plane and the MPI library")
    talk.add_argument("-q", "--quiet", action="store_true",
                      help="print warnings and errors only (no banner, epoch lines or summary)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, help_text in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if command is None or name == command:
            module = importlib.import_module(f"hpcgnn.commands.{name}")
            module.add_arguments(p)
            p.epilog = module.EXAMPLES   # --help ends with the command's examples
            p.formatter_class = argparse.RawDescriptionHelpFormatter
            p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    from hpcgnn.runtime import prefer_huge_pages, yield_when_oversubscribed

    prefer_huge_pages()  # before any subcommand allocates a tensor
    yield_when_oversubscribed()  # before any subcommand starts MPI
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        command = next((a for a in argv if not a.startswith("-")), None)
        args = build_parser(command if command in SUBCOMMANDS else "").parse_args(argv)
        log.configure(log.QUIET if args.quiet else min(args.verbose, 1))
        return int(args._module.run(args) or 0)
    except InputError as exc:
        log.error(str(exc))    # rank 0's only: under mpiexec every rank parses the same line
        return EXIT_INPUT
    except BrokenPipeError:
        # Output piped into `head` and closed early: not an error of ours.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:
        # an output that cannot be written (a full disk, a lost permission): one line, exit 2
        from hpcgnn.runtime import write_failure_message

        line = write_failure_message(exc)
        if line is None:
            raise
        print(f"hpcgnn: error: {line}", file=sys.stderr, flush=True)
        return EXIT_INPUT
    except KeyboardInterrupt:
        print("hpcgnn: interrupted", file=sys.stderr)
        return 130
