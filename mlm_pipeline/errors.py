"""The pipeline's kinds of failure, one class each, and which of them a retry can cure.

Callers match these by type, never by class name or message (STYLE rule 15). Each
subclasses the built-in exception the code raised before it had a type of its own
(`ValueError`, `RuntimeError`), so an `except ValueError` written then still catches it.

A second try can cure (`is_transient`) a lost connection, a timeout, an I/O error other
than a missing or forbidden path, and a `TransientError` (a torchrun rank that died: the
retry resumes from the newest checkpoint); nothing else (`PERMANENT`, or any other
exception: a bug). `mlm_pipeline.tracking` adds the MLflow client's server errors. This
module imports nothing beyond the standard library.
"""

from __future__ import annotations

from pathlib import Path


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the file and field."""


class CorruptInputError(ValueError):
    """An input's bytes are damaged or are not what its manifest records (a checksum, a
    size or a format check failed); the message names the file."""


class MissingDependencyError(RuntimeError):
    """A package the command needs is not installed or cannot be imported; the message
    names it and says how to repair the install."""


class DataUnavailable(Exception):
    """A downstream task's labelled data cannot be obtained (no network, a missing local
    file, a pinned checksum that does not match, a missing optional package); the
    evaluation skips the task's figures and records the message as their reason."""


class CompileError(RuntimeError):
    """`torch.compile` could not build the model (`train.compile`)."""


class ResumeRefusedError(ValueError):
    """Continuing an unfinished MLflow run would go back, or change what it trains; the
    message names the run, the setting and what to do (`--fresh`,
    `tracking.resume_run_id`)."""


class RescoreUnavailable(ValueError):
    """The registry's champion cannot be scored on a new version's data (its checkpoint,
    tokenizer or text is missing or does not fit); the message says why."""


class OtherTokenizer(RescoreUnavailable):
    """The champion was trained with another tokenizer, whose digest is `digest`."""

    def __init__(self, digest: str) -> None:
        super().__init__(f"the champion's tokenizer has digest {digest[:12]}")
        self.digest = digest


class TransientError(Exception):
    """A failure a second try may cure (mixed into the class of such a failure)."""


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became non-finite (never cured by a retry).

    Attributes:
        step: the first non-finite optimizer step (1-based).
        last_checkpoint: the newest intact checkpoint (all written before `step`), or None.
    """

    def __init__(self, message: str, step: int, last_checkpoint: Path | None) -> None:
        super().__init__(message)
        self.step, self.last_checkpoint = step, last_checkpoint


class TrainingInterrupted(Exception):
    """Training stopped on a stop request (SIGINT, SIGTERM) after checkpointing `step` in
    `checkpoint`."""

    def __init__(self, step: int, checkpoint: Path) -> None:
        super().__init__(f"training interrupted at step {step}; checkpoint {checkpoint}")
        self.step, self.checkpoint = step, checkpoint


#: Never cured by a retry, whatever else the class is (an `OSError` subclass included).
PERMANENT: tuple[type[BaseException], ...] = (
    ConfigError, CorruptInputError, MissingDependencyError, CompileError, ResumeRefusedError,
    NonFiniteLossError, TrainingInterrupted, ImportError, FileNotFoundError, FileExistsError,
    PermissionError, IsADirectoryError, NotADirectoryError, KeyboardInterrupt,
)
#: Cured by a second try, unless `PERMANENT` (network and disk I/O, timeouts).
TRANSIENT: tuple[type[BaseException], ...] = (
    TransientError, ConnectionError, TimeoutError, OSError,
)


def is_transient(exc: BaseException) -> bool:
    """True when a second try may cure `exc` (see the module docstring): an instance of
    `TRANSIENT` and of no `PERMANENT` class, checked on `exc` alone (not its cause)."""
    return isinstance(exc, TRANSIENT) and not isinstance(exc, PERMANENT)
