"""argparse types and checks shared by the command-line tools: checked when the
arguments are parsed, before a run that may take minutes, never after it."""

from __future__ import annotations

import argparse
import importlib.util
import os
from typing import Optional


def whole_number_at_least(low):
    """argparse type: an int of at least ``low``."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


def write_error(path: str) -> Optional[str]:
    """Why a file cannot be written at ``path`` (as given: relative to the current
    folder), or None. Tried, not asked: os.access says yes to root, and on file systems
    such as sysfs, where the write then fails at the end of the run; a file that is not
    there yet is created and removed (a name too long, a folder's trailing slash)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{path!r} is a folder, not a file"
    if path.endswith(("/", os.sep)):
        return f"{path!r} names a folder (it ends in {path[-1]!r}), not a file"
    if not os.path.isdir(folder):
        return f"cannot write into {folder!r}: no such folder"
    try:
        if os.path.exists(path):
            open(path, "ab").close()  # appends nothing
        else:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            os.remove(path)
    except OSError as error:
        return f"cannot write {path!r}: {error.strerror or error}"
    return None


def writable_file(suffix=None):
    """argparse type: a path a file can be written to (``write_error``); with ``suffix``
    (e.g. ".png"), it must end so (what writes it picks the format by the name)."""
    def parse(text):
        if not text:
            raise argparse.ArgumentTypeError("expected a file name, got an empty one")
        error = write_error(text)
        if error is not None:
            raise argparse.ArgumentTypeError(error)
        if suffix is not None and not text.lower().endswith(suffix):
            raise argparse.ArgumentTypeError(f"{text!r} must end in {suffix}")
        return text
    return parse


def same_file_error(paths: dict):
    """A sentence if two of ``{flag: path}`` name one file (the second written would
    replace the first), else None."""
    seen = {}
    for flag, path in paths.items():
        if path is None:
            continue
        key = os.path.realpath(path)
        if key in seen:
            return f"{seen[key]} and {flag} name the same file {path!r}"
        seen[key] = flag
    return None


def missing_modules(what: str, names) -> Optional[str]:
    """Why ``what`` cannot run (a message naming the optional modules ``names`` that are
    not installed, all of them in the package's ``demo`` extra), or None."""
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (f"{what} cannot run without {' and '.join(missing)} (pip install "
            f"'shardadam[demo]', or pip install {' '.join(missing)})")
