"""The command line behind launch.py: one module per command (or family of small ones), each with
an `add(subparsers)` that declares its options; `main` parses and dispatches.

    demo     cli/demo.py     tensor-parallel matmul and MLP checked against NumPy
    embed    cli/embed.py    MiniLM sentence embeddings
    generate cli/generate.py text from a llama-family GGUF model
    serve    cli/serve.py    an OpenAI-compatible server with continuous batching
    synthetic cli/synthetic.py a llama GGUF file of any shape with random weights
    devices, run, keys, worker    cli/tools.py

`bench` and `stress` are bench/commands.py's, which launch.py adds (`extra`): cli/ imports no
benchmark.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence

from cli import demo, embed, generate, serve, synthetic, tools
from split_state.errors import MetaError

COMMANDS = (demo, embed, generate, serve, synthetic, tools)


def parser(description: str = "", extra: Sequence = ()) -> argparse.ArgumentParser:
    """The command line of COMMANDS and of the `extra` modules (each with an `add(subparsers)`)."""
    ap = argparse.ArgumentParser(
        prog="launch.py", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="command", required=True)
    for module in (*COMMANDS, *extra):
        module.add(sub)
    for command in sub.choices.values():
        command.set_defaults(parser=command)  # an unknown option is told with this command's usage
    return ap


def main(argv: list[str] | None, environ: Mapping[str, str], description: str = "", extra: Sequence = ()) -> int:
    args, unknown = parser(description, extra).parse_known_args(argv)
    if unknown:
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.environ = environ
    try:
        return args.fn(args)
    except MetaError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
