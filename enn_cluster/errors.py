"""Errors a user can fix. The CLI prints them as one line and exits with code 2.

A message never carries a credential: whatever value it quotes (a URL, an image reference,
a list printed whole) passes through `redact`, which masks what looks like one (a password
in `user:PASS@`, `?token=`-style query and fragment values, `Bearer ...`, well-known token
prefixes). The config checks refuse such values by the same patterns (`looks_secret`).
"""
import re

# a query/fragment parameter that carries a credential: a name holding one of the first
# words anywhere, or one of the second as a whole part (X-Amz-Signature, api-key, not design)
_SECRET_PARAM = (r"[\w.-]*(?:token|secret|passw|passphrase|credential|apikey|authori[sz]ation)"
                 r"[\w.-]*|(?:[\w.-]*[-_.])?(?:sig|signature|key|code|auth|pwd|pass|session"
                 r"|cookie)(?:[-_.][\w.-]*)?")
_CREDENTIAL_PATTERNS = (
    # scheme://user:password@ or scheme://TOKEN@
    (re.compile(r"(\b[A-Za-z][\w+.-]*://)[^/\s@'\"]+@"), r"\1***@"),
    # user:password@host without a scheme (an Enroot/Pyxis image reference, a DSN)
    (re.compile(r"(?<![\w/:.@-])([\w.+-]+):[^@\s/:'\"]+@(?=[\w\[])"), r"\1:***@"),
    # ?token=..., &api-key=..., #access_token=...
    (re.compile(r"([?&#;](?:" + _SECRET_PARAM + r")=)[^&#;\s'\"]+", re.IGNORECASE), r"\1***"),
    # Authorization header values
    (re.compile(r"\b((?i:bearer)|Basic)\s+[A-Za-z0-9._~+/=-]{6,}"), r"\1 ***"),
    # well-known token shapes (GitHub, GitLab, Slack, Hugging Face, OpenAI-style, AWS key ids)
    (re.compile(r"\b(?:gh[opusr]_|github_pat_|glpat-|xox[abprs]-|hf_|sk-)[A-Za-z0-9_-]{10,}"
                r"|\bAKIA[0-9A-Z]{16}\b"), "***"),
)


def redact(text: str) -> str:
    """`text` with every credential-looking part masked as ***."""
    for pattern, replacement in _CREDENTIAL_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def looks_secret(value) -> bool:
    """Does this string hold what `redact` would mask?"""
    return isinstance(value, str) and redact(value) != value


class UserError(Exception):
    """Bad input (config, flag, path): the message names the field and the fix."""

    exit_code = 2

    def __init__(self, *args) -> None:
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


class ToolMissing(UserError):
    """An external program (podman, mksquashfs, sbatch, ...) is not installed."""


def did_you_mean(word: str, choices) -> str:
    """' (did you mean X?)' for the closest of `choices` to a mistyped `word`, else ''."""
    import difflib

    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""
