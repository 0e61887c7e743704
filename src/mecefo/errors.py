"""Why a CLI stops early. Bad user input (configs, paths, traces, corrupted files): the message and exit
status 2, before anything is written. A run that cannot go on (a non-finite loss or gradient norm, every
rank down under cluster.all_down='error'): the message naming the step and exit status 3, with the last
good checkpoint left as it was. A write that cannot succeed (a full disk, a read-only file system, a quota): one
line and exit status 3 at its first occurrence, the earlier checkpoint intact."""

import errno

UNWRITABLE = (errno.ENOSPC, errno.EROFS, errno.EDQUOT)  # a write that fails so will fail again: no retry


class UsageError(Exception):
    """One line saying which input is wrong and what is allowed."""


class TrainingStopped(RuntimeError):
    """One line naming the step at which training could not go on, and why."""


BAD_INPUT, CANNOT_GO_ON, INTERRUPTED = 2, 3, 130  # the exit statuses of every entry point


def unwritable(e: BaseException) -> OSError | None:
    """The OSError behind e (its causes and contexts, and the per-process failures DCP's CheckpointException
    gathers) that says a write cannot succeed: no space left (ENOSPC), a read-only file system (EROFS), a quota
    exceeded (EDQUOT); None if there is none."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in UNWRITABLE:
            return x
        todo += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)  # torch.distributed.checkpoint's CheckpointException: rank ->
        if isinstance(failures, dict):  # (exception, traceback)
            todo += [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]
    return None


def unwritable_line(e: OSError) -> str:
    """One line for a write that cannot succeed."""
    where = f" {e.filename}" if e.filename else ""
    return (f"cannot write{where}: {e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)}); a write that cannot "
            "succeed is not retried: make room (or the file system writable) and continue with --resume")


def guarded(main, interrupted: str = "interrupted"):
    """Run a CLI's main() and map why it stopped to one exit status, for every entry point (mecefo.train,
    mecefo.launch, mecefo.ft, the experiments): a UsageError is a one-line 'error: ...' and 2, a
    TrainingStopped a one-line 'stopped: ...' and 3, a write that cannot succeed (unwritable: a full disk, a
    read-only file system, a quota) a one-line 'stopped: ...' and 3 at its first occurrence, Ctrl-C
    (KeyboardInterrupt) the `interrupted` line and 130."""
    import sys

    def say(line: str) -> None:  # (on a full disk the log itself may not take it: the status still goes out)
        try:
            print(line, file=sys.stderr)
        except OSError:
            pass

    try:
        try:
            return main()
        except (UsageError, TrainingStopped, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # (DCP's CheckpointException is a BaseException)
            full = unwritable(e)
            if full is None:
                raise
            raise TrainingStopped(unwritable_line(full)) from None
    except UsageError as e:
        say(f"error: {e}")
        return BAD_INPUT
    except TrainingStopped as e:
        say(f"stopped: {e}")
        return CANNOT_GO_ON
    except KeyboardInterrupt:
        say(interrupted)
        return INTERRUPTED
