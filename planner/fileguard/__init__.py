"""What the tools may write and read: one guard for every output file, one atomic writer.

Every file ``dcp-plan``, ``dcp-train`` and ``dcp-calibrate`` write (plans, summaries, logs,
cost models, figures, reports; checkpoints through ``runtime.train.checkpoint``, which uses the
same pieces) goes through ``check_output`` before any work starts, and is written through
``atomic_output`` / ``write_atomic`` (a temporary in the same directory, fsynced, renamed over
the target, the directory fsynced) or, for an append-only log, ``open_log``.

``check_output(path, kind=..., inputs=...)`` refuses, naming the user's path and the reason:

- a path that is (resolves to, or is a hard link of) one of the run's ``inputs``, or another
  output of the same run (``others``);
- anything that is not a regular file: a directory, a FIFO, a device, a socket, whatever a
  symlink points to (``/dev/full``, ``/proc/self/fd/1``), a symlink loop;
- an existing regular file that is not this kind's own output (``KINDS``): a plan replaces only
  a plan (``overwrite`` lifts that one rule), a summary only a summary, a log appends only to an
  empty file or a log; so a dataset, a plan or a user's notes are never replaced by another
  kind of file;
- a name longer than the file system allows, a parent that is not a directory, or a directory
  where nothing can be created (read-only, no permission: found by creating and removing a
  probe file, so the real cause, ``EROFS`` or ``EACCES``, is known before the work).

Temporary names are ``.<name>.<tag>-<pid>`` (hashed to fit 255 bytes for long names); a later
write to the same path removes those whose process is gone (``kill -9`` leftovers). Errors of a
write are ``ValueError("PATH: cannot write the KIND: CAUSE (ERRNO)")`` and leave nothing behind;
removing the temporary never hides the error that made it necessary.
"""

from __future__ import annotations

from planner.fileguard.checks import (
    check_directory,
    check_input,
    check_output,
    os_error_text,
)
from planner.fileguard.kinds import KINDS, LOG_KEYS, OutputKind, is_plan_file
from planner.fileguard.temps import NAME_MAX, fsync_dir, remove_stale_temps, temp_path
from planner.fileguard.write import atomic_output, open_log, write_atomic

__all__ = [
    "KINDS",
    "LOG_KEYS",
    "NAME_MAX",
    "OutputKind",
    "atomic_output",
    "check_directory",
    "check_input",
    "check_output",
    "fsync_dir",
    "is_plan_file",
    "open_log",
    "os_error_text",
    "remove_stale_temps",
    "temp_path",
    "write_atomic",
]
