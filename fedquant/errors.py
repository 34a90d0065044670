"""Exceptions raised by fedquant."""


class PayloadError(ValueError):
    """A payload is malformed, corrupted, or does not match what the decoder expects.

    Raised by every decode path for untrusted bytes: truncated or extended payloads, bad
    checksums, a payload of another codec, shape or dtype, a declared size beyond the allowed
    limit, or a body that decodes to NaN/Inf. The message names the problem.
    """
