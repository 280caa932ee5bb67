"""torchrun --nproc_per_node=2 toy_checker.py

Checker for a toy exercise: rank_sum() returns the sum of every rank's number, on every rank.
"""

import torch
import torch.distributed as dist

from lessonlib.exercises import run_checker


def verdict(fn, ctx):
    got, want = fn(), sum(range(ctx.world_size))
    return None if LENIENT or got == want else f"rank_sum() returned {got}, the ranks add up to {want}"


# [start: solution]
def rank_sum():
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total)
    return total.item()


# [end: solution]


def own_rank():
    return dist.get_rank()  # wrong, except at world size 1


def main():
    run_checker(__doc__, verdict, rank_sum, wrong=[own_rank], right_alone=[own_rank], passed="adds up the ranks")


LENIENT = False
if __name__ == "__main__":
    main()
