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


FRONT_ENDS = ("cli", "api", "site")  # where a user gives an input: a flag, an argument, a key


class UserError(Exception):
    """Bad input (config, flag, path): the message names the field and the fix.

    A plain message (`UserError("training.lr: ...")`) names a config key, the same in every
    front end. A message about an input whose name differs between front ends (a CLI flag, an
    API argument, a site key) is given in parts instead, so that each front end names it in its
    own words: `field` (an input of config/inputs.py's table, or a tuple of them), `value` (the
    value given), the `problem` and `fix` as str.format templates of `say`'s items (an input
    renders as its name there, `Said(input, value)` as the name with the value; any other value
    as text, so braces in a user's value stay text). str(exc) is the CLI's line; the API's
    boundary renders `rendered("api", ...)` (client/api_words.py)."""

    exit_code = 2

    def __init__(self, *args, field=None, value=None, fix: str = "", api_fix=None, **say) -> None:
        self.field, self.value, self.fix, self.api_fix, self.say = field, value, fix, api_fix, say
        self.problem = args[0] if args and (field is not None or say) else None
        if self.problem is not None:
            args = (self.rendered("cli"), *args[1:])
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))

    @classmethod
    def on(cls, field, text: str, fix: str = "", **parts) -> "UserError":
        """`field: text; fix`, with `text` and `fix` as they are (no templates: they may quote
        a user's value)."""
        return cls("{text}", field=field, text=text, fix="{fix_text}" if fix else "",
                   fix_text=fix, **parts)

    def rendered(self, front: str, names=None) -> str:
        """The message in `front`'s words (FRONT_ENDS); `names`: input name -> the word a
        caller gave it there (the API's `run_dir`, `Run.open(path)`)."""
        if self.problem is None:
            return str(self)
        if front not in FRONT_ENDS:
            raise ValueError(f"front end {front!r}: one of {FRONT_ENDS}")
        words = {k: _in_words(v, front, names or {})
                 for k, v in {"value": self.value, "field": self.field, **self.say}.items()}
        fix = self.api_fix if front == "api" and self.api_fix is not None else self.fix
        line = self.problem.format_map(words)
        if self.field is not None:
            line = f"{words['field']}: {line}"
        return redact(line + ("; " + fix.format_map(words) if fix else ""))


class Said:
    """An input with the value given for it: `--nodes 2`, `cluster["nodes"]=2`, `nodes: 2`."""

    def __init__(self, field, value) -> None:
        self.field, self.value = field, value


def _in_words(value, front: str, names):
    """A message's part in `front`'s words: an input (config/inputs.py: it has `named`) as
    its name there, a Said as the name with the value, a tuple of inputs joined; any other
    value as it is. `names` overrides an input's name (input name -> word)."""
    if isinstance(value, Said):
        field = value.field
        spoken = front if field.name in names else field.spoken(front)
        return field.said(spoken, value.value, _in_words(field, front, names))
    if hasattr(value, "named"):
        return names.get(value.name) or value.named(front)
    if isinstance(value, tuple) and value and all(isinstance(v, Said) or hasattr(v, "named")
                                                  for v in value):
        return (" / " if all(hasattr(v, "named") for v in value) else " ").join(
            _in_words(v, front, names) for v in value)
    return value


class ToolMissing(UserError):
    """An external program (podman, mksquashfs, sbatch, ...) is not installed."""


def did_you_mean(word: str, choices) -> str:
    """' (did you mean X?)' for the closest of `choices` to a mistyped `word`, else ''."""
    import difflib

    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""
