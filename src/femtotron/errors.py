"""Errors a user can fix. The CLI prints them as plain text (no traceback) and exits with `exit_code`."""


class FemtotronError(Exception):
    """A problem with what the user asked for, explained with the field or file and the fix."""

    exit_code = 1
    same_on_every_rank = False  # True: every rank raises it alike, and only rank 0 prints it
    heading = "error"  # the CLI prints `femtotron: {heading}: {message}`


class PathError(FemtotronError):
    """A path given on the command line is missing or is not what the command reads: a run directory
    without its files, a directory without an HF model. The one rule for exit 1 (README, errors.md)."""

    exit_code = 1


class ConfigError(FemtotronError):
    """The configuration breaks a rule; the message lists every problem found."""

    exit_code = 2
    same_on_every_rank = True


class UsageError(FemtotronError):
    """A command-line argument is out of range (argparse's own errors exit 2 as well)."""

    exit_code = 2


class DataError(FemtotronError):
    """A dataset file is missing, mismatched or corrupt."""

    exit_code = 3


class DistributedError(FemtotronError):
    """The process group could not be formed or a collective did not complete."""

    exit_code = 4


class TrainingDiverged(FemtotronError):
    """The loss or gradients went non-finite (or fp16 overflowed at the smallest scale): training stopped."""

    exit_code = 5
    same_on_every_rank = True


class OutOfMemory(FemtotronError):
    """A rank ran out of memory; the message gives its model state, its memory, and what to lower first."""

    exit_code = 8


class WriteError(FemtotronError, OSError):
    """A file could not be written: the disk or quota is full, the file system is read-only, or no permission.
    Also an OSError, so code catching OSError for a path still does."""

    exit_code = 9

    def __str__(self) -> str:  # the message alone, not OSError's "[Errno N] ..." form
        return str(self.args[0])


class TrainingInterrupted(FemtotronError):
    """SIGTERM or SIGUSR1 (sent by schedulers before preemption) or Ctrl-C: a checkpoint was saved, the run
    stopped. Planned, so not printed as an error."""

    exit_code = 7
    same_on_every_rank = True
    heading = "stopped"


def is_out_of_memory(error: BaseException) -> bool:
    """torch.OutOfMemoryError on GPUs; on the CPU a RuntimeError saying "can't allocate memory"."""
    oom = type(error).__name__ == "OutOfMemoryError" or "can't allocate memory" in str(error)
    return isinstance(error, MemoryError) or (isinstance(error, RuntimeError) and oom)
