"""The three ways a training run ends early; `training.main` turns each into one line and an exit status."""


class UsageError(Exception):
    """A mistake in the command line, the corpus or the files given: the message says what to fix."""


class TrainingFault(Exception):
    """The run itself failed (non-finite loss, hub unreachable...): the message says what is kept on disk."""


class RunInterrupted(Exception):
    """SIGINT or SIGTERM arrived; a checkpoint was saved. `exit_code` is 128 + the signal number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum
