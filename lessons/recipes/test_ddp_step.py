"""python -m pytest -q lessons/recipes/test_ddp_step.py

Test your own DDP training step on a machine without GPUs: copy this file next to your code, put your
model, optimizer, data and step in the region `your_code` (or import them there), and run pytest on it.
It needs torch and pytest, nothing else, on Linux or macOS. Each rank runs this file as a script
(`python test_ddp_step.py RANK WORLD_SIZE FOLDER`), so what the region imports must be importable from
this file's folder or installed (`pip install -e .`), not only from pytest's rootdir.

Two tiers, one question: does the step, run by two ranks under DDP, train as one process would?
- Real processes (test_replicas_stay_equal, test_gradient_matches_one_process): two Python processes,
  real gloo, a FileStore in a temporary folder (no port at all), the whole run bounded by RUN_TIMEOUT.
  The code path your training job takes. A few seconds, most of it importing torch twice.
- One process (test_threaded_group_trains_as_one_process, test_fake_group_builds_rank_7_of_8): torch's
  threaded and fake process groups. Milliseconds, but both live in torch's private testing modules, and
  each checks less; see their docstrings.
"""

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WORLD_SIZE = 2
STEPS = 3
RUN_TIMEOUT = 120  # seconds for the two-process run, start-up included: a hang fails, it does not stall CI
GROUP_TIMEOUT = timedelta(seconds=30)  # a collective that a rank never joins raises after this


# [start: your_code]
def make_model():
    torch.manual_seed(0)  # every rank and the one-process run start from the same weights
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def make_batch(step):
    """The global batch of a step: every rank makes the same one and keeps its own part of it."""
    gen = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)


def train_step(model, optimizer, x, y):
    optimizer.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


# [end: your_code]


def shard(tensor, rank, world_size):
    """This rank's equal part of the global batch (DDP averages gradients: equal parts, one process's mean)."""
    assert len(tensor) % world_size == 0, f"the global batch ({len(tensor)}) must divide by {world_size} ranks"
    return tensor.chunk(world_size)[rank]


def train(model, rank, world_size, steps=STEPS):
    """Run `steps` steps of train_step on this rank's part of each batch, in whatever process group is
    initialized (none: one process on the whole batch). Returns the first step's gradients and the final
    weights and buffers, by name."""
    optimizer = make_optimizer(model)
    net = model.module if isinstance(model, DDP) else model
    for step in range(steps):
        x, y = make_batch(step)
        train_step(model, optimizer, shard(x, rank, world_size), shard(y, rank, world_size))
        if step == 0:  # train_step zeroes the gradients first, so after it they are this step's
            grads = {n: p.grad.detach().clone() for n, p in net.named_parameters() if p.grad is not None}
            assert grads, "no gradients after train_step: zero them at the start of the step, not at the end"
    return {"grads": grads, "state": {k: v.detach().clone() for k, v in net.state_dict().items()}}


def check_replicas_equal(results):
    """After the last step every rank holds bit-for-bit the same weights: DDP keeps replicas equal only if
    every rank applies the same update."""
    first = results[0]["state"]
    for rank, result in enumerate(results[1:], start=1):
        for name, value in first.items():
            other = result["state"][name]
            assert torch.equal(value, other), (
                f"after {STEPS} steps rank {rank}'s {name} differs from rank 0's by up to "
                f"{(value - other).abs().max().item():.3g}: the ranks applied different updates"
            )


def check_gradients_match(results, reference):
    """The first step's gradient on every rank equals one process's gradient on the whole global batch."""
    for rank, result in enumerate(results):
        assert result["grads"].keys() == reference["grads"].keys(), f"rank {rank} has gradients for other parameters"
        for name, want in reference["grads"].items():
            torch.testing.assert_close(
                result["grads"][name],
                want,
                msg=lambda m, rank=rank, name=name: f"rank {rank}'s gradient of {name} is not one process's:\n{m}",
            )


def rank_main(rank, world_size, folder):
    """What each of the processes runs: python THIS_FILE RANK WORLD_SIZE FOLDER."""
    store = dist.FileStore(os.path.join(folder, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT)
    try:
        torch.save(train(DDP(make_model()), rank, world_size), os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def tail(path, chars=3000):
    with open(path, errors="replace") as f:
        return f.read()[-chars:]


def run_processes(world_size, timeout=RUN_TIMEOUT):
    """Start world_size processes of this file, wait for all of them, at most `timeout` seconds in all, and
    return their results. A failed rank fails the test at once with its output; no process outlives this."""
    with tempfile.TemporaryDirectory() as folder:
        procs, logs = [], [os.path.join(folder, f"rank{rank}.log") for rank in range(world_size)]
        try:
            for rank in range(world_size):
                with open(logs[rank], "wb") as log:  # a file, not a pipe: a rank that prints a lot cannot block
                    command = [sys.executable, os.path.abspath(__file__), str(rank), str(world_size), folder]
                    procs.append(
                        subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                    )
            deadline, timed_out = time.monotonic() + timeout, False
            while any(p.poll() is None for p in procs):
                if any(p.poll() not in (None, 0) for p in procs):
                    break  # a rank failed: the others would only wait for it in a collective
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.05)
        finally:
            for p in procs:  # each rank leads its own session: kill it and anything it started
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # the rank and everything it started have ended
                p.wait()
        codes = [p.returncode for p in procs]
        if any(code != 0 for code in codes):
            told = "\n".join(f"--- rank {r} (exit {c}):\n{tail(logs[r])}" for r, c in enumerate(codes))
            why = f"the ranks ran past {timeout} s and were killed" if timed_out else "a rank failed"
            pytest.fail(f"{why}:\n{told}", pytrace=False)
        return [torch.load(os.path.join(folder, f"rank{rank}.pt")) for rank in range(world_size)]


@pytest.fixture(scope="module")
def processes():
    return run_processes(WORLD_SIZE)  # one run, shared by the two tests below


@pytest.fixture(scope="module")
def one_process():
    return train(make_model(), rank=0, world_size=1)


# [start: process_tests]
def test_replicas_stay_equal(processes):
    check_replicas_equal(processes)


def test_gradient_matches_one_process(processes, one_process):
    check_gradients_match(processes, one_process)


# [end: process_tests]


# [start: threaded]
def test_threaded_group_trains_as_one_process(one_process):
    """The same two checks with WORLD_SIZE threads of this process as the ranks, through torch's threaded
    process group: collectives that really combine the ranks' tensors, without starting a process.
    Private (torch.testing._internal, seen on torch 2.14.1): it may change in any release. The ranks share
    one interpreter: torch's global random generator, module-level state, and autograd, which the group
    runs single-threaded; gloo, NCCL and their timeouts are not involved."""
    threaded = pytest.importorskip("torch.testing._internal.distributed.multi_threaded_pg")
    models = [make_model() for _ in range(WORLD_SIZE)]  # here, not in the threads: they share the generator
    results, errors, store = [None] * WORLD_SIZE, [], dist.HashStore()

    def rank_thread(rank):
        try:
            dist.init_process_group("threaded", store=store, rank=rank, world_size=WORLD_SIZE)
            results[rank] = train(DDP(models[rank]), rank, WORLD_SIZE)
            dist.destroy_process_group()
        except BaseException as error:
            errors.append((rank, error))
            threaded.ProcessLocalGroup.exception_handle(error)  # wakes the ranks waiting in a collective

    threaded._install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # a process group per thread
    try:
        threads = [threading.Thread(target=rank_thread, args=(rank,), daemon=True) for rank in range(WORLD_SIZE)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=RUN_TIMEOUT)
        assert not any(thread.is_alive() for thread in threads), f"a rank ran past {RUN_TIMEOUT} s"
    finally:
        threaded.ProcessLocalGroup.reset()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        threaded._uninstall_threaded_pg()
    assert not errors, f"rank {errors[0][0]} raised: {errors[0][1]!r}"
    check_replicas_equal(results)
    check_gradients_match(results, one_process)


# [end: threaded]


# [start: fake]
def test_fake_group_builds_rank_7_of_8():
    """One process plays rank 7 of 8 with torch's fake process group: every collective returns at once and
    combines nothing, so it checks what depends on the rank and the world size (the split, DDP's
    construction, the forward pass), never a value. In torch 2.14.1 DDP's backward on it fails inside DDP's
    all-reduce hook (an internal assert), so a whole step cannot run there. Private: the "fake" backend is
    registered by torch.testing._internal.distributed.fake_pg, which init_process_group imports itself."""
    pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    rank, world_size = 7, 8
    dist.init_process_group("fake", rank=rank, world_size=world_size)
    try:
        model = DDP(make_model())
        x, _ = make_batch(0)
        part = shard(x, rank, world_size)
        assert model(part).shape[0] == len(x) // world_size
    finally:
        dist.destroy_process_group()


# [end: fake]


if __name__ == "__main__":  # one rank of run_processes
    rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
