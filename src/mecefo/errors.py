"""Why a CLI stops early. Bad user input (configs, paths, traces, corrupted files): the message and exit
status 2, before anything is written. A run that cannot go on (a non-finite loss or gradient norm, every
rank down under cluster.all_down='error'): the message naming the step and exit status 3, with the last
good checkpoint left as it was."""


class UsageError(Exception):
    """One line saying which input is wrong and what is allowed."""


class TrainingStopped(RuntimeError):
    """One line naming the step at which training could not go on, and why."""


def guarded(main):
    """Run a CLI's main(); a UsageError becomes a one-line message and exit status 2."""
    import sys

    try:
        return main()
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
