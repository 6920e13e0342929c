"""Command-line conventions shared by ``dcp-plan``, ``dcp-train`` and ``dcp-calibrate``.

One place for what a user of Megatron-LM or torchtitan expects of every command: ``--version``,
defaults shown in ``--help``, integer flags that say which flag was wrong, Megatron's flag names
as aliases, Megatron flags that have no meaning here refused with what to use instead, error
messages that name flags rather than Python fields, and machine-readable summaries
(``--json`` on stdout, ``--summary-json FILE``).

Aliases are extra option strings of the same argparse action (same ``dest``), so an alias can
never give a different plan than the short name: argparse cannot tell them apart.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

__all__ = [
    "EFFORT_HELP",
    "ArgumentParser",
    "HelpFormatter",
    "add_json_arguments",
    "add_version",
    "emit_summary",
    "flag_message",
    "glue_negative_values",
    "int_at_least",
    "int_list",
    "nonnegative_int",
    "positive_float",
    "positive_int",
    "refuse",
    "resolve_steps",
    "seed_int",
    "step_bounds",
    "step_range",
    "version_string",
]


EFFORT_HELP = (
    "solver effort. fast: the placement heuristic only; balanced: also refines steps more than "
    "2%% over their bound (target search, a short CP-SAT); max: more targets and microbatch "
    "counts, 10x the CP-SAT time. Measured on 1M Wikipedia lengths (whole run, CPU s, time over "
    "the tight bound; BENCHMARKS.md): N = 64: fast 3.2 s 1.0166x, balanced 3.2 s 1.0107x, max "
    "32.7 s 1.0102x; N = 256: fast 2.5 s 1.0203x, balanced 3.3 s 1.0139x, max 36.0 s 1.0134x. "
    "max costs ~10x for plans ~0.05%% faster")
"""``--effort``'s help (``dcp-plan`` and ``compare``): what each level does and costs."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions as written and adds ``(default: X)`` to every option with a default.

    Unlike ``argparse.ArgumentDefaultsHelpFormatter`` it leaves out defaults that say nothing
    (``None``, ``False`` of a switch, an empty string or list) and help that already names one.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default is argparse.SUPPRESS or default is None
                or default is False or default in ("", (), []) or "default" in text
                or action.nargs == 0):
            return text
        if isinstance(default, (list, tuple)):
            return f"{text} (default: {','.join(str(x) for x in default)})"
        return f"{text} (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """Every command's parser: no abbreviations and unknown flags named.

    argparse's default ``allow_abbrev=True`` takes any unique prefix for a flag, so ``--cp-size
    2`` silently meant ``--cp-sizes 2`` (a valid, wrong plan). Here a flag is spelled in full;
    an unknown one is an error naming it and the closest real flags.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    _argv: list[str] | None = None
    _depth = 0

    def _remember(self, args: Any) -> None:
        # The whole command line, for error(): intermixed parsing calls parse_known_args again
        # with parts of it, and parse_args reports unknown flags after the parse returned.
        if self._depth == 0:
            self._argv = list(sys.argv[1:] if args is None else args)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._remember(args)
        self._depth += 1
        try:
            return super().parse_known_args(args, namespace)
        finally:
            self._depth -= 1

    def parse_known_intermixed_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._remember(args)
        self._depth += 1
        try:
            return super().parse_known_intermixed_args(args, namespace)
        finally:
            self._depth -= 1

    def _unknown_flags(self) -> list[str]:
        known = {o for a in self._actions for o in a.option_strings}
        return [w.split("=", 1)[0] for w in self._argv or ()
                if w.startswith("--") and len(w) > 2 and w.split("=", 1)[0] not in known]

    def error(self, message: str) -> NoReturn:
        unknown = self._unknown_flags()
        if unknown and (message.startswith("unrecognized arguments")
                        or message.startswith("the following arguments are required")):
            # An unknown flag first: it is usually why a required one seems missing
            # (--max-tokens 4096 for --max-tokens-per-rank 4096).
            shown = [o for a in self._actions if a.help is not argparse.SUPPRESS
                     for o in a.option_strings if o.startswith("--")]
            hints = []
            for flag in unknown:
                close = difflib.get_close_matches(flag, shown, n=3, cutoff=0.6)
                hints.append(f"{flag} (did you mean {' or '.join(close)}?)" if close else flag)
            message = (f"unknown flag{'s' if len(unknown) > 1 else ''}: {', '.join(hints)} "
                       f"(flags are spelled in full; see {self.prog} --help)"
                       + ("; " + message if message.startswith("the following") else ""))
        super().error(message)


def version_string(prog: str) -> str:
    """``prog VERSION (plan format N, Python X.Y)``."""
    from planner.planfile.version import CREATOR_VERSION, FORMAT_VERSION

    try:
        version = metadata.version("dcp-planner")
    except metadata.PackageNotFoundError:  # run from a source tree without installing
        version = CREATOR_VERSION
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    return f"{prog} {version} (plan format {FORMAT_VERSION}, Python {py})"


def exit_on_version(prog: str, argv: list[str] | None = None) -> None:
    """Print the version line and exit 0 if the command line asks for ``--version``, before the
    command imports anything heavy (torch for ``dcp-train`` and ``dcp-calibrate``: issue 29). The
    same answer as the parser's ``--version``, which stays for ``--help``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" in args:  # what follows is not an option
        args = args[: args.index("--")]
    if "--version" in args:
        print(version_string(prog))
        raise SystemExit(0)


def add_version(parser: argparse.ArgumentParser) -> None:
    """``--version``: print the version line and exit 0."""
    parser.add_argument("--version", action="version", version=version_string(parser.prog),
                        help="print the version and exit")


def _int_type(name: str, low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text.strip().replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {name}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {name}, got {value}")
        return value

    parse.__name__ = name  # argparse names the type in some messages
    return parse


positive_int = _int_type("a positive integer", 1)
"""argparse ``type`` for integers >= 1 (``--steps abc``: 'expected a positive integer')."""
nonnegative_int = _int_type("an integer >= 0", 0)
"""argparse ``type`` for integers >= 0."""


MAX_SEED = 2**64 - 1
"""Seeds are 64-bit: the permutation keys (splitmix64) and torch's generators take 0..2^64-1;
a larger one would alias a small seed (taken modulo 2^64)."""


def seed_int(text: str) -> int:
    """argparse ``type`` for a seed: an integer in 0..2^64-1."""
    try:
        value = int(text.strip().replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a seed (an integer), got {text!r}") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected a seed in 0..2^64-1 "
                                         f"(0..{MAX_SEED}), got {value}")
    return value


def int_at_least(low: int) -> Callable[[str], int]:
    """argparse ``type`` for integers >= ``low``."""
    return _int_type(f"an integer >= {low}", low)


def positive_float(text: str) -> float:
    """argparse ``type`` for finite floats > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def int_list(text: str) -> tuple[int, ...]:
    """argparse ``type`` for a comma-separated list of ints (``1,2,4``)."""
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of ints such as 1,2,4, got {text!r}") from None


def step_range(text: str) -> tuple[int | None, int | None]:
    """argparse ``type``: a Python slice of steps, ``A:B``, ``A:``, ``:B`` (steps A..B-1;
    negative counts from the end: ``-3:`` is the last three). A bare number is refused: ``-3``
    reads as "the last three" and as "step -3", ``3`` as "the first three" (``dcp-train --steps
    3``) and as "step 3"; the message gives the spellings of each.

    Returns (start, stop) as given (None where omitted); ``resolve_steps`` applies them to a
    plan's step count.
    """
    a, colon, b = text.partition(":")
    try:
        lo = int(a) if a.strip() else None
        hi = int(b) if b.strip() else None
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a step range A:B such as 0:10 (or A:, :B, -3: for the last three), got "
            f"{text!r}") from None
    if not colon:
        if lo is None:
            raise argparse.ArgumentTypeError(f"expected a step range A:B, got {text!r}")
        # A bare number reads two ways ('-3': the last three, or step -3 alone; '3': the first
        # three, as dcp-train --steps 3 counts, or step 3), so it is refused with both spellings.
        alone = f"'{lo}:{lo + 1 if lo != -1 else ''}' is step {lo} alone"
        other = (f"'{lo}:' the last {-lo}" if lo < 0 else
                 f"':{lo}' the first {lo}, '{lo}:' from step {lo}")
        raise argparse.ArgumentTypeError(
            f"expected a step range A:B, got {text!r}, a bare number: {other}; {alone} "
            "(--step I prints one step's rows)")
    return lo, hi


def resolve_steps(flag: str, given: tuple[int | None, int | None], num_steps: int) -> range:
    """The steps a ``step_range`` selects in a plan of ``num_steps`` steps, as Python slices them.

    Raises:
        ValueError: the range selects no step, naming ``flag`` and the plan's step range.
    """
    lo, hi = given
    steps = range(num_steps)[slice(lo, hi)]
    if not steps:
        text = f"{'' if lo is None else lo}:{'' if hi is None else hi}"
        raise ValueError(f"{flag} {text} selects no step; the plan has {num_steps} steps "
                         f"({step_bounds(num_steps)})")
    return steps


def step_bounds(num_steps: int) -> str:
    """``0..31, or -32..-1 from the end`` for a plan of 32 steps."""
    return f"0..{num_steps - 1}, or -{num_steps}..-1 from the end"


def glue_negative_values(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``--steps -3:`` as ``--steps=-3:``: argparse takes a value starting with '-' for an
    option unless it is glued on with '='."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in flags and i + 1 < len(argv) and argv[i + 1].startswith("-") \
                and argv[i + 1][1:2].isdigit():
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


class _Refuse(argparse.Action):
    """A known flag of another tool that means nothing here: fail, saying what to use."""

    def __init__(self, option_strings: list[str], dest: str, hint: str = "",
                 **kwargs: Any) -> None:
        kwargs.setdefault("nargs", "?")
        kwargs.setdefault("help", argparse.SUPPRESS)
        super().__init__(option_strings, dest=argparse.SUPPRESS, **kwargs)
        self.hint = hint

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        parser.error(f"{option_string} is not used by {parser.prog}: {self.hint}")


def refuse(parser: argparse.ArgumentParser, hints: Mapping[str, str]) -> None:
    """Refuse each flag of ``hints`` (Megatron's, usually) with its hint; hidden from --help."""
    for flag, hint in hints.items():
        parser.add_argument(flag, action=_Refuse, hint=hint)


def error_text(e: BaseException) -> str:
    """The text of a user error; an OSError that names no path because the working directory
    is gone (deleted under the shell: every relative path fails with a bare ``[Errno 2]``)
    says so."""
    if isinstance(e, FileNotFoundError) and e.filename is None:
        try:
            os.getcwd()
        except FileNotFoundError:
            return ("the working directory no longer exists (deleted or moved away): relative "
                    "paths, the default output among them, cannot be resolved; cd to an "
                    "existing directory or give absolute paths")
    return str(e)


def flag_message(message: str, flags: Mapping[str, str]) -> str:
    """``message`` with Python field names (``long_sequences``) replaced by their flags.

    Library errors name fields, which is right for Python callers; a command line user needs the
    flag. Only whole words are replaced, and only fields with a flag of their own whose name is
    unmistakably a field (``long_sequences``, ``vpp=``): a plain word such as ``device`` or
    ``steps`` is left alone, since it also occurs in ordinary text ("No space left on device").
    """
    flags = {f: flag for f, flag in flags.items() if "_" in f or not f[-1].isalnum()}
    if not flags:
        return message
    # A key ending in a word character must end a word ("min_cp" not "min_cpu"); a key such as
    # "vpp=" carries its own end.
    parts = [re.escape(f) + (r"(?![\w/.-])" if f[-1].isalnum() or f[-1] == "_" else "")
             for f in sorted(flags, key=len, reverse=True)]
    pattern = re.compile(r"(?<![\w./-])(" + "|".join(parts) + ")")
    return pattern.sub(lambda m: flags[m.group(1)], message)


def add_json_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--json`` (the summary as one JSON object on stdout) and ``--summary-json FILE``."""
    parser.add_argument("--json", action="store_true",
                        help="print the summary as one JSON object on stdout (instead of text)")
    parser.add_argument("--summary-json", metavar="FILE", default="",
                        help="also write the summary as JSON to FILE")


def _plain(value: Any) -> Any:
    """JSON-ready copy: numpy scalars become Python numbers, tuples lists, paths strings."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item") and callable(value.item):  # numpy scalar
        return value.item()
    return value


def emit_summary(summary: Mapping[str, Any], text: str, *, as_json: bool, json_path: str,
                 quiet: bool = False) -> None:
    """Print ``text`` (or, with ``as_json``, the summary as JSON) and write ``json_path``.

    The file is written to a temporary name beside it and renamed: a reader never sees half
    (``planner.fileguard.write_atomic``, which refuses a file that is not a summary; callers
    check the path with ``check_output(kind="summary")`` before their work starts).
    """
    doc = json.dumps(_plain(summary), sort_keys=True, indent=None)
    if as_json:
        print(doc, flush=True)
    elif not quiet and text:
        print(text, flush=True)
    if json_path:
        from planner.fileguard import write_atomic

        write_atomic(json_path, json.dumps(_plain(summary), sort_keys=True, indent=2) + "\n",
                     kind="summary")
