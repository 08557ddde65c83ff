"""Writing the run's files so that a failed write is one clear line.

A write can fail for a full disk, a quota, a file size limit, an I/O error
or a read-only file system; the libraries under us report that in their own
ways (an OSError, a TensorFlow error, a RuntimeError that wraps one, a
message). `write_failure` recognises all of them and gives the one line the
run stops with; `write_atomically` writes a small file through a temporary
one that never outlives a failure.
"""

import errno
import os
from typing import Optional

from etils import epath


class WriteError(RuntimeError):
  """A file of the run (checkpoint, metrics, config) could not be written."""


_REASONS = {errno.ENOSPC: "the disk is full (no space left on device)",
            errno.EDQUOT: "the disk quota is exceeded",
            errno.EFBIG: "a file would exceed the file size limit",
            errno.EIO: "an input/output error",
            errno.EROFS: "the file system is read-only"}
# How the errors read when only their message survives (TensorFlow's, or a
# RuntimeError that orbax raises from an OSError in another thread).
_MARKERS = {"No space left": errno.ENOSPC, "Disk quota": errno.EDQUOT,
            "File too large": errno.EFBIG, "Read-only file": errno.EROFS,
            "RESOURCE_EXHAUSTED: No space": errno.ENOSPC}


def write_failure(error: BaseException, what: str) -> Optional[WriteError]:
  """A one-line WriteError when `error` (or what caused it) is a failed
  write (full disk, quota, file size limit, I/O error); else None."""
  seen, current = set(), error
  while current is not None and id(current) not in seen:
    seen.add(id(current))
    code = getattr(current, "errno", None)
    if code not in _REASONS:
      code = next((c for m, c in _MARKERS.items() if m in str(current)), None)
    if code in _REASONS:
      return WriteError(f"Could not write {what}: {_REASONS[code]}. Free "
                        "space (or raise the limit) and run the same command "
                        "again: it resumes from the last complete "
                        "checkpoint.")
    current = current.__cause__ or current.__context__
  return None


def is_remote(path) -> bool:
  """A path of an object store (gs://...): no appends, no exclusive
  create, renames are copies."""
  return "://" in os.fspath(path)


def write_atomically(path, text: str, what: Optional[str] = None) -> None:
  """Writes `text` to `path` through a temporary file renamed over it.

  Raises:
    WriteError: the write failed for lack of space (or the like); no
      temporary file is left and `path` is as it was.
  """
  path = epath.Path(path)
  tmp = path.parent / (path.name + ".tmp")
  try:
    tmp.write_text(text)
    tmp.replace(path)
  except Exception as e:  # pylint: disable=broad-except
    try:
      if tmp.exists():
        tmp.unlink()
    except OSError:
      pass
    failure = write_failure(e, what or str(path))
    if failure is None:
      raise
    raise failure from None
