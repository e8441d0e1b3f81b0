"""kvq's status codes (kvq.h's kvq_status) as exception types. Every failed C call raises the type of its status
with the message the library kept on the handle."""


class KvqError(Exception):
    """Base of every kvq error; `status` is the C status code."""

    status = None


class KvqSpecError(KvqError):
    """The spec has errors. `diagnostics` lists them (each with file, line, col, severity, message); str() names the
    first as "file:line:col: error: message"."""

    status = 1

    def __init__(self, message, diagnostics=()):
        super().__init__(message)
        self.diagnostics = list(diagnostics)

    @property
    def file(self):
        return self.diagnostics[0].file if self.diagnostics else None

    @property
    def line(self):
        return self.diagnostics[0].line if self.diagnostics else None

    @property
    def col(self):
        return self.diagnostics[0].col if self.diagnostics else None


class KvqInvalidError(KvqError, ValueError):
    status = 2


class KvqShapeError(KvqError, ValueError):
    status = 3


class KvqNoMemoryError(KvqError, MemoryError):
    status = 4


class KvqIOError(KvqError, OSError):
    status = 5


class KvqFormatError(KvqError):
    status = 6


class KvqUnavailableError(KvqError):
    status = 7


class KvqUnsupportedError(KvqError):
    status = 8


class KvqStateError(KvqError):
    status = 9


class KvqInternalError(KvqError):
    status = 10


_BY_STATUS = {c.status: c for c in (KvqSpecError, KvqInvalidError, KvqShapeError, KvqNoMemoryError, KvqIOError,
                                   KvqFormatError, KvqUnavailableError, KvqUnsupportedError, KvqStateError,
                                   KvqInternalError)}


def error_for(status, message):
    """The exception for a C status (KvqError for an unknown one)."""
    cls = _BY_STATUS.get(int(status), KvqError)
    e = cls(message) if cls is not KvqSpecError else KvqSpecError(message)
    e.status = int(status)
    return e
