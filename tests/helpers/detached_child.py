"""python detached_child.py SECONDS: start a child in a session of its own (as torchrun starts its
ranks), print its pid, then sleep SECONDS (tests/test_launcher.py: run_bounded and started must end
that child too, whether this script finishes or is killed)."""

import subprocess
import sys
import time

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(float(sys.argv[1]))
