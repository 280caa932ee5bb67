"""What lessons do differently on a machine with a GPU, which CI (no GPU) never runs, checked on any machine.

Each workaround answers a line of torch that misbehaves there. The test finds that line in the installed
torch, so an upgrade that changes it fails here and the workaround can go, and checks that the lesson
still applies the workaround where it must (before torch starts CUDA).
"""

import inspect

import pytest
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from lessonlib import ROOT

pytestmark = pytest.mark.unit


def test_powersgd_synchronizes_cuda_for_cpu_tensors_so_14_hooks_hides_the_gpus():
    """Seen on an NVIDIA H200 (torch 2.11): with a GPU present, PowerSGD on CPU tensors raises "Expected a
    cuda device, but got: cpu" from torch.cuda.synchronize(device) in its decompress step."""
    source = inspect.getsource(powerSGD_hook)
    assert source.count("if torch.cuda.is_available():\n            torch.cuda.synchronize(device)") == 2, (
        "torch's PowerSGD no longer synchronizes CUDA for any device: lessons/14_hooks.py may stop hiding the GPUs"
    )
    lesson = (ROOT / "lessons" / "14_hooks.py").read_text()
    hide = lesson.index('os.environ["CUDA_VISIBLE_DEVICES"] = ""')
    assert hide < lesson.index("\nimport torch"), "14_hooks.py must hide the GPUs before it imports torch"
