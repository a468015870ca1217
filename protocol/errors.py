"""The error types raised when untrusted bytes or records are rejected."""


class ProtocolError(ValueError):
    """Base class: something received from the network (or a file) is not acceptable."""


class DecodeError(ProtocolError):
    """Bytes that are not a well-formed message: bad msgpack, wrong types, missing fields."""


class TooLargeError(DecodeError):
    """A message or a field is larger than its limit."""


class FieldError(DecodeError):
    """A field has the wrong type or a value out of its allowed range."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"field {field!r}: {problem}")
        self.field = field
        self.problem = problem


class VersionError(DecodeError):
    """A message from a protocol version this build cannot read."""


class SignatureError(ProtocolError):
    """A signature is missing, malformed, does not verify, or its key does not match the claimed peer id."""
