"""Bad user input (configs, paths, traces, corrupted files): the CLIs print the message and exit with status 2."""


class UsageError(Exception):
    """One line saying which input is wrong and what is allowed."""


