"""Errors the user can act on. Their message is one line that names the file, the row and what is wrong."""


class BadInput(ValueError):
    """The input, the tokenizer or an option is wrong; nothing was published. The CLI exits 2."""


class BadRow(ValueError):
    """One row is wrong. It is raised as a BadInput naming the row, or, with `on_bad_row="skip"`, counted.

    It does not know where it is: readers locate a row only when the error is raised, because finding a
    JSONL line number means counting the lines before the slice.
    """

    def __init__(self, reason: str, detail: str):
        self.reason = reason  # a short key the skips are counted by, e.g. "malformed_json"
        self.detail = detail
        super().__init__(detail)

    def __reduce__(self):  # rows are encoded in other processes too: rebuild it with both fields
        return type(self), (self.reason, self.detail)

    def at(self, where: str) -> BadInput:
        return BadInput(f"{where}: {self.detail}")


class CacheError(RuntimeError):
    """A published cache or a staged shard is missing, corrupt or does not match its manifest."""


class Failed(RuntimeError):
    """A command could not finish, for a reason its message names in one line (a run's failed slices, a server
    still in use); doing it again can succeed. The CLI exits 1."""


class OutOfSpace(RuntimeError):
    """A shard could not be written for lack of disk space (or a file size limit); rerunning resumes."""


def one_line(error: BaseException | str, limit: int = 400) -> str:
    """An error's message on one line: every line of it, whitespace collapsed, cut at `limit` characters."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def first_line(error: BaseException | str) -> str:
    """An error's message up to its first line break: what a one-line report of it says."""
    return (str(error).strip().splitlines() or [""])[0]
