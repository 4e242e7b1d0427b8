"""Why a file in the prompt cache's disk tier was not used: the reasons `DiskIoCounters.files_rejected` counts.

Each is a miss, never a failure: the file is deleted (but an entry that is not a
regular file, which is skipped and left alone) and its entry, if it had one, is
gone. The disk tier (`engine/prompt_cache/files.py`, `engine/prompt_cache/directory.py`)
decides which; `/v1/cache/stats` and `/metrics` report every reason, zeros included.
"""

from __future__ import annotations

from enum import StrEnum


class FileRejection(StrEnum):
    NOT_A_FILE = "not_a_file"  # a directory, FIFO, socket, device or symbolic link named like a snapshot file
    FORMAT = "format"  # another format version (an older server's files, which carry no MAC): never trusted
    UNAUTHENTICATED = "unauthenticated"  # its MAC does not verify under the directory's key: not written here
    CORRUPT = "corrupt"  # not a snapshot file, truncated, or failing its digests or size bounds
    FOREIGN = "foreign"  # written for another model identity
    LAYOUT = "layout"  # a declared array or layer the served model's state does not have: never reaches MLX
