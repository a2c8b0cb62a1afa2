"""The named errors of msgaudit, in one place.

Every public entry point raises one of these with a message that says what is wrong and what
to do; the CLI turns them into one line and a non-zero exit code (`audit.core.vocabulary.ExitCode`),
never a traceback.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType

from audit.core.vocabulary import ExitCode


class MsgauditError(Exception):
    """Base of every error msgaudit raises on purpose."""

    exit_code: int = ExitCode.INPUT.value


class ConfigError(MsgauditError):
    """The config file is missing, unreadable, or has a bad key or value."""


class SetupError(MsgauditError):
    """A dependency of the local stack is missing: Java, Maven, cached jars, a free port."""


class BrokerError(MsgauditError):
    """The local Kafka broker could not be started, stopped or reached."""


class InputError(MsgauditError):
    """An input table, topic, window or argument is missing or malformed."""


class LedgerError(MsgauditError):
    """A ledger segment could not be written or read."""


class SlaFailed(MsgauditError):
    """At least one error-severity SLA rule failed (exit code 3 so schedulers can alert)."""

    exit_code = ExitCode.SLA_FAILED.value


class LakeBusy(MsgauditError):
    """Another writer holds the lake's writer lease (one ingest per lake at a time)."""

    exit_code = ExitCode.LAKE_BUSY.value


class ResultReleased(MsgauditError):
    """A reconcile result's Spark rows were read after its `release()` freed what they are computed from."""

    exit_code = ExitCode.UNEXPECTED.value


def _one_line(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
    """A script's uncaught MsgauditError: its one line on stderr, as the CLI prints it (the message
    says what to do; MSGAUDIT_TRACEBACK=1 shows the traceback). Any other exception as before."""
    if isinstance(error, MsgauditError) and os.environ.get("MSGAUDIT_TRACEBACK", "") in ("", "0"):
        print(f"msgaudit: {error}", file=sys.stderr)
    else:
        sys.__excepthook__(kind, error, tb)


def install_excepthook() -> None:
    """Make an uncaught MsgauditError end a program with one line (only over Python's own hook)."""
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = _one_line
