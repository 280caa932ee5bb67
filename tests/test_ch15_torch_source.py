"""What chapter 15 quotes or states from the installed torch's own source, found there (no process).

The chapter says, for torch 2.14.1: DDP's reducer reduces its buckets "in a predetermined order consistent
across processes" and rebuilds them once, after the first iteration, syncing rank 0's assignment
(reducer.hpp, the C++ header torch installs); DDP broadcasts buffers at the start of every forward by
default, under `forward_sync_buffers`, `broadcast_buffers` being deprecated since 2.13; `fully_shard`'s
`reduce_dtype=None` reduces in the compute dtype. A torch upgrade that changes any of these fails here,
naming the file, instead of leaving the chapter's sentence behind.
"""

import inspect
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit


def words(text):
    """The text with C++ and Python comment markers and line breaks turned into single spaces."""
    return re.sub(r"\s+", " ", re.sub(r"^\s*(//|#)", " ", text, flags=re.M))


def test_the_reducer_header_says_what_the_chapter_quotes():
    import torch

    header = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/reducer.hpp"
    if not header.exists():
        pytest.skip(f"this torch installs no C++ headers ({header} is absent)")
    text = words(header.read_text())
    for quote in (
        "the buckets are reduced in a predetermined order consistent across processes",
        "We only rebuild buckets once after the first iteration and never rebuild them if find_unused_parameters_",
        "void sync_bucket_indices(",
        "bool rebuild_buckets();",
    ):
        assert quote in text, f"{header}: no longer says {quote!r}"


def test_ddp_syncs_buffers_before_every_forward_by_default():
    from torch.nn.parallel import DistributedDataParallel as DDP

    doc = words(DDP.__doc__)
    assert "forward_sync_buffers (bool or None): Flag that enables syncing (broadcasting) buffers" in doc, doc
    assert "including at the beginning of ``forward``" in doc and "When ``None``, defaults to ``True``" in doc
    assert ".. deprecated:: 2.13 Use ``forward_sync_buffers`` instead." in doc
    params = inspect.signature(DDP).parameters
    assert params["forward_sync_buffers"].default is None and params["broadcast_buffers"].default is None


def test_fully_shards_reduce_dtype_none_means_the_compute_dtype():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    doc = words(MixedPrecisionPolicy.__doc__)
    assert "If this is ``None`` but ``param_dtype`` is not ``None``, then the reduction uses the compute dtype" in doc
    assert MixedPrecisionPolicy().reduce_dtype is None


def test_torchs_first_bucket_is_one_mebibyte():
    import torch.distributed as dist

    assert dist._DEFAULT_FIRST_BUCKET_BYTES == 2**20
