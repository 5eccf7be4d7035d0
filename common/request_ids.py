"""One request id, the same in the logs of every service a request passes: the gateway takes its
client's (HTTP `x-request-id`, gRPC metadata of that name) or makes one, and passes it on
(GenerateRequest.request_id, then NewSequence.request_id); a direct caller of a scheduler may
give its own. Checked here, for every service alike."""

import re
import secrets

from common.errors import InvalidArgument

# The header (HTTP) and metadata key (gRPC) a client may name its request with.
REQUEST_ID_KEY = "x-request-id"
MAX_REQUEST_ID_CHARS = 64
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def new_request_id() -> str:
    """A fresh id: 16 hex digits."""
    return secrets.token_hex(8)


def checked_request_id(text: str, field: str = "request_id") -> str:
    """`text` as a request id, or a new one when it is empty; INVALID_ARGUMENT naming `field`
    when it is not 1-64 characters of [A-Za-z0-9._:-] (a log line must not be forged)."""
    if not text:
        return new_request_id()
    if not _REQUEST_ID.fullmatch(text):
        raise InvalidArgument(f"{field} must be 1-{MAX_REQUEST_ID_CHARS} characters of "
                              f"A-Z a-z 0-9 . _ : - (got {text[:80]!r})")
    return text
