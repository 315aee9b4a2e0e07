"""argparse types and checks shared by the command-line tools: checked when the
arguments are parsed, before a run that may take minutes, never after it."""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
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


def writable_file(suffix=None):
    """argparse type: a path a file can be written to, neither a folder nor in a
    folder that is missing or read-only; with ``suffix`` (e.g. ".png"), it must end so
    (what writes it picks the format by the name)."""
    def parse(text):
        path = os.path.abspath(text)
        folder = os.path.dirname(path)
        if not text:
            raise argparse.ArgumentTypeError("expected a file name, got an empty one")
        if os.path.isdir(path):
            raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
        if not os.path.isdir(folder):
            raise argparse.ArgumentTypeError(f"cannot write into {folder!r}: no such folder")
        # Tried, not asked: os.access says yes to root, and on file systems such as
        # sysfs, where the write then fails at the end of the run.
        try:
            with tempfile.TemporaryFile(dir=folder):
                pass
            if os.path.exists(path):
                open(path, "ab").close()  # appends nothing
        except OSError as error:
            raise argparse.ArgumentTypeError(
                f"cannot write {text!r}: {error.strerror or error}") from None
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
