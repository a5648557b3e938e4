"""The error raised for unreadable, corrupt or mismatched checkpoints."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded as asked: a checksum mismatch, a missing file, a config that does not match
    the model. The message names the file and the field."""
