"""Errors a user can fix. The CLI prints them as plain text (no traceback) and exits with `exit_code`."""


class FemtotronError(Exception):
    """A problem with what the user asked for, explained with the field or file and the fix."""

    exit_code = 1
    same_on_every_rank = False  # True: every rank raises it alike, and only rank 0 prints it


class ConfigError(FemtotronError):
    """The configuration breaks a rule; the message lists every problem found."""

    exit_code = 2
    same_on_every_rank = True


class DataError(FemtotronError):
    """A dataset file is missing, mismatched or corrupt."""

    exit_code = 3


class DistributedError(FemtotronError):
    """The process group could not be formed or a collective did not complete."""

    exit_code = 4
