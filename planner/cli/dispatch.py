"""`dcp-plan [COMMAND] ...`: the command line to a subcommand, and errors to exit statuses.

The first word picks the subcommand (``validate``, ``show``, ``plan``, ``compare``, ``report``,
``tokenize``);
anything else is the default, ``plan``. User errors (``ValueError``, ``OSError``,
``EngineError``) print one line naming the flag, file or sample and exit 2, never a traceback;
SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 (``guard.ENDING_SIGNALS``) and Ctrl-C exit 128 + the signal
after the writer's cleanup; a reader that leaves a
pipe (``dcp-plan show ... | head``) is not an error.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from planner.cli.args import error_text, flag_message
from planner.cli.flags import FLAGS
from planner.cli.guard import Terminated, interrupting_signal, signals_raise, terminate
from planner.cli.plan import cmd_plan
from planner.cli.show import cmd_show
from planner.cli.validate import cmd_validate
from planner.config import EngineError

PROG = "dcp-plan"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from planner.cli.compare import cmd_compare
    from planner.cli.pretokenize import cmd_tokenize
    from planner.cli.report import cmd_report

    commands = {"validate": cmd_validate, "show": cmd_show, "plan": cmd_plan,
                "compare": cmd_compare, "report": cmd_report, "tokenize": cmd_tokenize}
    cmd = cmd_plan
    if argv and argv[0] in commands:
        cmd = commands[argv.pop(0)]
    with signals_raise(terminate):
        return _run(cmd, argv)


EXTRAS = {"pandas": "notebook", "polars": "notebook", "matplotlib": "notebook",
          "torch": "runtime", "ray": "ray", "megatron": "megatron", "torchtitan": "torchtitan",
          "transformer_engine": "gpu"}
"""Optional packages (pyproject.toml's extras): which extra installs each."""


def missing_extra(e: ImportError) -> str | None:
    """The message for an optional package that is not installed (``pip install .`` without
    extras), naming the extra that brings it; None for any other import error."""
    chain: BaseException | None = e
    while chain is not None:
        name = getattr(chain, "name", None)
        top = name.split(".")[0] if isinstance(name, str) else ""
        if isinstance(chain, ModuleNotFoundError) and top in EXTRAS:
            return (f"this command needs {top}, which is not installed: pip install "
                    f"'dcp-planner[{EXTRAS[top]}]' (or pip install '.[{EXTRAS[top]}]' in a "
                    "checkout)")
        chain = chain.__cause__ or chain.__context__
    return None


def _run(cmd: Any, argv: list[str]) -> int:
    try:
        return int(cmd(argv))
    except ImportError as e:
        message = missing_extra(e)
        if message is None:
            raise
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `dcp-plan show ... | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, OSError, EngineError) as e:
        print(f"{PROG}: error: {flag_message(error_text(e), FLAGS)}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Terminated, SystemError) as e:
        # The writer's cleanup ran on the way out (temporary files removed, nothing renamed).
        # A SystemError is a signal only when one is in its chain (see interrupting_signal).
        signum = interrupting_signal(e)
        if signum is None:
            raise
        print(f"{PROG}: interrupted by {signal.Signals(signum).name}; no plan written",
              file=sys.stderr)
        return 128 + signum


def entry() -> None:
    """The ``dcp-plan`` console script: ``main``, then exit without the interpreter's teardown.

    Every file is closed and every temporary removed when ``main`` returns, and the standard
    streams are flushed here; what the skipped teardown would do is free the numba and Arrow
    state, about 0.15 s of every run (a run's fixed cost is ~0.75 s; BENCHMARKS.md, issue 14).
    """
    code = main()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # the reader left (`| head`): nothing more to say
        pass
    os._exit(code)
