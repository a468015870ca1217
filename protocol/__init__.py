"""shoal.protocol: wire and record formats (msgpack, strict validation, Ed25519 signatures); no torch, no I/O."""

PROTOCOL_VERSION = 1
