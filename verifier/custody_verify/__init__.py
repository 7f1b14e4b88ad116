"""custody-verify: an independent verifier for Custody's audit-log transparency log.

Written from the C2SP specifications (signed-note, tlog-checkpoint, tlog-cosignature,
tlog-proof, tlog-witness), RFC 9162 and docs/audit-schema.md; it shares no code with the
Rust implementation.
"""

__version__ = "0.1.0"


class VerifyError(Exception):
    """Raised when anything fails to parse or verify; the message says what."""


__all__ = ["VerifyError", "__version__"]
