"""Why a CLI stops early. Bad user input (configs, paths, traces, corrupted files): the message and exit
status 2, before anything is written. A run that cannot go on (a non-finite loss or gradient norm, every
rank down under cluster.all_down='error'): the message naming the step and exit status 3, with the last
good checkpoint left as it was."""


class UsageError(Exception):
    """One line saying which input is wrong and what is allowed."""


class TrainingStopped(RuntimeError):
    """One line naming the step at which training could not go on, and why."""


BAD_INPUT, CANNOT_GO_ON, INTERRUPTED = 2, 3, 130  # the exit statuses of every entry point


def guarded(main, interrupted: str = "interrupted"):
    """Run a CLI's main() and map why it stopped to one exit status, for every entry point (mecefo.train,
    mecefo.launch, mecefo.ft, the experiments): a UsageError is a one-line 'error: ...' and 2, a
    TrainingStopped a one-line 'stopped: ...' and 3, Ctrl-C (KeyboardInterrupt) the `interrupted` line and 130."""
    import sys

    try:
        return main()
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return BAD_INPUT
    except TrainingStopped as e:
        print(f"stopped: {e}", file=sys.stderr)
        return CANNOT_GO_ON
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return INTERRUPTED
