"""torchrun --nproc_per_node=2 lessons/03_set_epoch.py

Shuffling belongs to the sampler, and the sampler needs set_epoch(epoch) before every epoch.

DistributedSampler shuffles with a generator seeded by seed + epoch, and `epoch` changes only when
you call set_epoch. Forget it and every epoch replays epoch 0's order, on every rank. Nothing fails;
the model just sees the same sequence of batches again and again. The lesson shows that, and two
checks that catch it in code: one that looks at the sampler, one that compares the orders seen.
Then the two other ways to get it wrong: shuffle=True on the DataLoader as well (a real error), and
a set_epoch that not every rank calls (the ranks then shuffle differently and the shards overlap).
"""

import argparse

import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import lessonlib


# [start: guards]
def check_set_epoch(loader, epoch):
    """Raise if the loader's DistributedSampler was not moved to `epoch` (call before iterating)."""
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler) and sampler.shuffle and sampler.epoch != epoch:
        raise RuntimeError(
            f"epoch {epoch}: the DistributedSampler is still at epoch {sampler.epoch}; "
            f"call loader.sampler.set_epoch({epoch}) before iterating"
        )


class RepeatWatch:
    """Works for any sampler: raise when an epoch's order equals an earlier epoch's."""

    def __init__(self):
        self.seen = {}

    def __call__(self, epoch, order):
        earlier = self.seen.setdefault(tuple(order), epoch)
        if earlier != epoch:
            raise RuntimeError(
                f"epoch {epoch} repeats the sample order of epoch {earlier}: "
                f"is sampler.set_epoch(epoch) called at the start of every epoch?"
            )


# [end: guards]


def train_orders(loader, epochs, call_set_epoch, guards=()):
    """The order of sample indices each epoch (the dataset is range(n), so a batch is its indices)."""
    watch, orders = RepeatWatch(), []
    for epoch in range(epochs):
        if call_set_epoch:
            loader.sampler.set_epoch(epoch)
        if "sampler" in guards:
            check_set_epoch(loader, epoch)
        orders.append([i for batch in loader for i in batch.tolist()])
        if "order" in guards:
            watch(epoch, orders[-1])
    return orders


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--size", type=int, default=16, choices=range(8, 1001), metavar="8..1000")
    parser.add_argument("--epochs", type=int, default=3, choices=range(2, 11), metavar="2..10")
    args = parser.parse_args()
    ctx = lessonlib.setup()
    data = range(args.size)

    # [start: forgotten]
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=True, seed=0))
    forgot = train_orders(loader, args.epochs, call_set_epoch=False)
    # [end: forgotten]
    assert all(order == forgot[0] for order in forgot), f"rank {ctx.rank}: epochs differ without set_epoch"
    caught = {}
    for guard in ["sampler", "order"]:
        try:
            train_orders(loader, args.epochs, call_set_epoch=False, guards=[guard])
        except RuntimeError as e:
            caught[guard] = str(e)
    assert len(caught) == 2, f"rank {ctx.rank}: a guard missed the forgotten set_epoch: {caught}"

    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=True, seed=0))
    right = train_orders(loader, args.epochs, call_set_epoch=True, guards=["sampler", "order"])
    lessonlib.report("orders", {"forgot": forgot, "set_epoch": right, "caught": caught})
    print(
        f"rank {ctx.rank}: without set_epoch every epoch is {forgot[0][:6]}...; with it epoch 1 starts {right[1][:6]}"
    )

    # [start: shuffle_twice]
    try:
        DataLoader(data, batch_size=4, shuffle=True, sampler=DistributedSampler(data))
    except ValueError as e:
        error = str(e)
    # [end: shuffle_twice]
    assert "mutually exclusive" in error, error
    lessonlib.report("shuffle_twice", error)

    # [start: main_only]
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    if ctx.is_main:  # wrong: set_epoch inside a main-rank-only block
        sampler.set_epoch(1)
    mine = list(sampler)
    # [end: main_only]
    shards = [None] * ctx.world_size
    dist.all_gather_object(shards, mine)
    seen = [i for shard in shards for i in shard]
    doubled = sorted({i for i in seen if seen.count(i) > 1})
    missing = sorted(set(data) - set(seen))
    pad = len(seen) - args.size
    lessonlib.report("main_only", {"doubled": doubled, "missing": missing, "padding": pad})
    if ctx.is_main:
        print(
            f"set_epoch on rank 0 only: {len(missing)} sample(s) never seen this epoch {missing}, "
            f"{len(doubled)} seen more than once (padding alone would explain {pad})"
        )
    # Every sample missing from the epoch is matched by one seen twice: the ranks cut two different
    # shuffles, so the pieces no longer fit together.
    assert len(seen) - len(set(seen)) == len(missing) + pad, "the counts of missing and doubled do not add up"
    lessonlib.teardown()


if __name__ == "__main__":
    main()
