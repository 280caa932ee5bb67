"""Each rank says it is ready (TEST_READY_DIR/rank<N>.ready), then sleeps ten minutes (tests/test_terminal.py)."""

import os
import time

open(os.path.join(os.environ["TEST_READY_DIR"], f"rank{os.environ['RANK']}.ready"), "w").close()
print(f"rank {os.environ['RANK']}: sleeping", flush=True)
time.sleep(600)
