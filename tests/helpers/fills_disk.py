"""Each rank writes a file into the temporary folder (TMPDIR), 64 KiB at a time, until the disk is full,
as a lesson saving checkpoints there would; the write that fails raises OSError (ENOSPC).

Used by tests/test_env_faults.py on a small tmpfs mounted as TMPDIR: the ranks' stdout and stderr are on
the same disk, so the traceback cannot be written either. The file stays (the test unmounts the disk).
Needs no process group.
"""

import os
import tempfile

rank = int(os.environ["RANK"])
print(f"rank {rank} fills the disk", flush=True)
with open(os.path.join(tempfile.gettempdir(), f"fill-rank{rank}.bin"), "wb") as f:
    while True:
        f.write(b"x" * 65536)
        f.flush()
