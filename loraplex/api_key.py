"""The key a CLI command presents: read from `--api-key-file`, else `$LORAPLEX_API_KEY`. There is no
flag that holds the key itself: a command line is visible to every user of the machine (`ps`)."""

import argparse
import os
import pathlib

ENV_VAR = "LORAPLEX_API_KEY"


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key-file", default="",
                        help=f"file holding your API key (default: ${ENV_VAR}); keys never go on "
                             "a command line")


def read(args: argparse.Namespace) -> str:
    """The caller's key: --api-key-file, else $LORAPLEX_API_KEY, else "" (none). A named file that
    cannot be read raises OSError."""
    if args.api_key_file:
        return pathlib.Path(args.api_key_file).read_text().strip()
    return os.environ.get(ENV_VAR, "").strip()
