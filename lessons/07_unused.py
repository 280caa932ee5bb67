"""torchrun --nproc_per_node=2 lessons/07_unused.py

find_unused_parameters: a parameter that forward() did not use, and the error DDP raises for it.

DDP all-reduces a bucket when every gradient in it has arrived. A parameter the forward pass did not
use gets no gradient, so its bucket never completes, and the next forward() raises the real error
shown here ("Expected to have finished reduction in the prior iteration..."), at the second
iteration, on every rank and at every world size. With `find_unused_parameters=True`, DDP walks the
autograd graph after each forward to find such parameters and marks them ready itself. Two results
asserted: a parameter no rank used keeps `.grad` None; a parameter that only some ranks used gets
the sum of those ranks' gradients divided by the world size, the others counting as zero.
"""

import argparse

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import lessonlib
from lessonlib.training import gather


# [start: model]
class TwoHeads(torch.nn.Module):
    """A shared body and two heads; each forward uses one head only."""

    def __init__(self):
        super().__init__()
        self.body, self.head_a, self.head_b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)

    def forward(self, x, head):
        return (self.head_a if head == "a" else self.head_b)(self.body(x))


# [end: model]


def build():
    torch.manual_seed(0)
    return TwoHeads()


def without_flag(iters):
    """The iteration at which DDP refuses to go on, and its message."""
    ddp = DDP(build())
    for i in range(iters):
        try:
            ddp(torch.randn(2, 4), "a").sum().backward()  # head_b gets no gradient
        except RuntimeError as e:
            return i + 1, str(e)
    return None, None


def with_flag(ctx):
    """Head a on every rank: head_b's grad stays None. Head a on rank 0 only: averaged with zeros."""
    # [start: flag]
    ddp = DDP(build(), find_unused_parameters=True)
    # [end: flag]
    for _ in range(2):
        ddp.zero_grad()
        ddp(torch.randn(2, 4), "a").sum().backward()
    assert ddp.module.head_b.weight.grad is None, "a parameter no rank used should have no gradient"

    head = "a" if ctx.rank == 0 else "b"
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(ctx.rank))
    local = build()  # the same weights, no DDP: this rank's own gradient
    local(x, head).sum().backward()
    own = local.head_a.weight.grad if head == "a" else torch.zeros_like(local.head_a.weight)
    ddp = DDP(build(), find_unused_parameters=True)
    ddp(x, head).sum().backward()
    expected = sum(gather(own)) / ctx.world_size
    got = ddp.module.head_a.weight.grad
    assert torch.allclose(got, expected, atol=1e-6), f"rank {ctx.rank}: head_a grad {got} != {expected}"
    return {"ddp": got.flatten().tolist(), "rank 0 alone": gather(own)[0].flatten().tolist()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--iters", type=int, default=3, choices=range(2, 11), metavar="2..10")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu")

    failed_at, error = without_flag(args.iters)
    assert failed_at == 2 and "Expected to have finished reduction" in error, (failed_at, error)
    lessonlib.report("error", {"iteration": failed_at, "message": error})
    grads = lessonlib.report("with_flag", with_flag(ctx))
    if ctx.is_main:
        print(f"without find_unused_parameters: iteration {failed_at} raised RuntimeError:")
        print("  " + error.splitlines()[0][:200])
        print(
            f"with it: head_b.grad is None; head_a used by rank 0 only, grad = rank 0's / {ctx.world_size}: "
            f"{[round(v, 4) for v in grads['ddp']]} vs rank 0's own {[round(v, 4) for v in grads['rank 0 alone']]}"
        )
    lessonlib.teardown()


if __name__ == "__main__":
    main()
