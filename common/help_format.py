"""argparse help for every loraplex command and service: descriptions kept as written (line
breaks and all), and each option's default shown after its help unless the help already says it
(`loraplex serve gateway --help`, `loraplex up --help`)."""

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.default not in (None, False, "", [], (), argparse.SUPPRESS)
        if (shown and action.option_strings and "default" not in text
                and action.nargs != 0):
            text += (" " if text else "") + "(default: %(default)s)"
        return text
