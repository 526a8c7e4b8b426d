"""The one error type of jaxpar.checkpoint: a one-line message naming the checkpoint or config key."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, read or used; the message is one line."""
