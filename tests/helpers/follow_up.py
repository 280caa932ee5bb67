"""A rank that says who it is and ends (tests/test_faults.py's follow-up launch).

No lessonlib.report here (nor in faults.py's "say" mode): it imports torch into every rank, a second and a
half of CPU each, which a 2-core CI machine running that file's dozens of ranks would feel.
"""

import os

print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} follows up", flush=True)
