"""Training text: the Python standard library's own source, read at run time.

Every machine that runs Python has it, so the demo needs no download. The launcher
builds the corpus file once and every rank of every phase reads that one file, so all
ranks see identical bytes. Needs no torch: the launcher stays light.
"""

import hashlib
import os
import sysconfig

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class CorpusError(RuntimeError):
    """Not enough readable Python source to train on."""


def _stdlib_sources(root):
    """Paths of the standard library's .py files, in a fixed (sorted) order."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def build_corpus(path, max_bytes):
    """Writes up to ``max_bytes`` of standard-library source to ``path``.

    Returns a description (source folder, files, bytes, sha256) for the report.
    """
    root = sysconfig.get_paths()["stdlib"]
    chunks, size, files = [], 0, 0
    for source in _stdlib_sources(root):
        try:
            with open(source, "rb") as f:
                text = f.read()
        except OSError:
            continue  # an unreadable file is simply not part of the corpus
        text = text[: max_bytes - size]
        chunks.append(text)
        size += len(text)
        files += 1
        if size >= max_bytes:
            break
    data = b"".join(chunks)
    if len(data) < 1 << 16:
        raise CorpusError(f"found only {len(data)} bytes of Python source under {root}")
    with open(path, "wb") as f:
        f.write(data)
    return {"source": root, "files": files, "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}
