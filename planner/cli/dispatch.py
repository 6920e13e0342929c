"""`dcp-plan [COMMAND] ...`: the command line to a subcommand, and errors to exit statuses.

The first word picks the subcommand (``validate``, ``show``, ``plan``, ``compare``, ``report``,
``tokenize``);
anything else is the default, ``plan``. User errors (``ValueError``, ``OSError``,
``EngineError``) print one line naming the flag, file or sample and exit 2, never a traceback;
memory that ran out (``ulimit -v``, a full host: ``oom``) is one line too, exit 2;
SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 (``guard.ENDING_SIGNALS``) and Ctrl-C exit 128 + the signal
after the writer's cleanup; a reader that leaves a
pipe (``dcp-plan show ... | head``) is not an error.
"""

from __future__ import annotations

import functools
import importlib
import os
import signal
import sys
from typing import Any

from planner.cli.args import error_text, flag_message
from planner.cli.flags import FLAGS
from planner.cli.guard import Terminated, interrupting_signal, signals_raise, terminate
from planner.cli.oom import PLAN_HINT, out_of_memory
from planner.config import EngineError

PROG = "dcp-plan"


COMMANDS = {"validate": "planner.cli.validate:cmd_validate", "show": "planner.cli.show:cmd_show",
            "plan": "planner.cli.plan:cmd_plan", "compare": "planner.cli.compare:cmd_compare",
            "report": "planner.cli.report:cmd_report",
            "tokenize": "planner.cli.pretokenize:cmd_tokenize"}
"""Each subcommand's function, imported when it runs (inside ``_run``: an import that runs out
of memory is reported as such)."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv.pop(0) if argv and argv[0] in COMMANDS else "plan"
    with signals_raise(terminate):
        return _run(functools.partial(_call, name), argv)


def _call(name: str, argv: list[str]) -> int:
    module, func = COMMANDS[name].split(":")
    return int(getattr(importlib.import_module(module), func)(argv))


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
    except (ImportError, MemoryError) as e:
        message = out_of_memory(e, PLAN_HINT) or (
            missing_extra(e) if isinstance(e, ImportError) else None)
        if message is None:
            raise
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `dcp-plan show ... | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, OSError, EngineError) as e:
        message = out_of_memory(e, PLAN_HINT) or flag_message(error_text(e), FLAGS)
        print(f"{PROG}: error: {message}", file=sys.stderr)
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
    except Exception as e:  # pyarrow's own errors, a thread that could not start, ...
        message = out_of_memory(e, PLAN_HINT)
        if message is None:
            raise
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2


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
