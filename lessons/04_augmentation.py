"""torchrun --nproc_per_node=4 lessons/04_augmentation.py

Do the ranks draw the same random crops? Measured for six ways of seeding, with torchvision v2.

Options: --cases a,b,c,d,e,f (the default: all six).

Each rank gets different images (DistributedSampler), but what matters here is the random crop and
flip each rank applies at each step. v2 applies one call's random parameters to every image passed
in that call, so each image travels with a coordinate grid (channels: row, column): equal grids out
mean equal crop parameters. The cases, on every rank:
  a  torch.manual_seed(seed), num_workers=0          crops identical across ranks
  b  same seed, num_workers=2, no loader generator   identical: worker k of every rank gets the same seed
  c  same seed, num_workers=2, generator seed + rank different: the generator seeds the workers
  d  same seed, num_workers=0, generator seed + rank identical: without workers the transforms draw
                                                     from the global RNG, which the generator never touches
  e  torch.manual_seed(seed + rank), num_workers=0   different
  f  torch.manual_seed(seed + rank), num_workers=2   different: base_seed comes from the per-rank RNG
Reported: the fraction of step positions at which every rank drew the same crop (asserted for
world size > 1: 100% for a, b, d; under 20% for c, e, f; null at world size 1, where nothing compares).
"""

import argparse

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import tv_tensors
from torchvision.transforms import v2

import lessonlib

CASES = {  # name: (seed torch with seed + rank?, num_workers, loader generator seeded seed + rank?)
    "a": (False, 0, False),
    "b": (False, 2, False),
    "c": (False, 2, True),
    "d": (False, 0, True),
    "e": (True, 0, False),
    "f": (True, 2, False),
}
SAME = {"a", "b", "d"}


class Images(torch.utils.data.Dataset):
    """Synthetic 3x24x24 images, each paired with a grid that records where the crop came from."""

    def __init__(self, n, size=24):
        self.images = torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(1))
        rows, cols = torch.meshgrid(torch.arange(float(size)), torch.arange(float(size)), indexing="ij")
        self.grid = torch.stack([rows, cols])
        self.transform = v2.Compose([v2.RandomResizedCrop(16, antialias=True), v2.RandomHorizontalFlip()])

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        # Both as Image: v2 transforms every Image of one call with the same random parameters.
        image, grid = self.transform(tv_tensors.Image(self.images[i]), tv_tensors.Image(self.grid))
        return image.as_subclass(torch.Tensor), grid.as_subclass(torch.Tensor)


def crops(case, seed, ctx, n_images, batch_size):
    """This rank's crop grids, one per sample, in the order the loader delivered them."""
    per_rank_seed, workers, per_rank_generator = CASES[case]
    # [start: seeding]
    torch.manual_seed(seed + ctx.rank if per_rank_seed else seed)
    generator = torch.Generator().manual_seed(seed + ctx.rank) if per_rank_generator else None
    dataset = Images(n_images)
    sampler = DistributedSampler(dataset, ctx.world_size, ctx.rank, shuffle=False)
    loader = DataLoader(
        dataset, batch_size, sampler=sampler, num_workers=workers, generator=generator, timeout=20 if workers else 0
    )  # a stuck worker: an error, not a hang (0 without workers)
    # [end: seeding]
    return torch.cat([grid for _, grid in loader])


def box(grid):
    """A crop as [top, left, bottom, right, flipped] in source pixels, read off its coordinate grid."""
    (top, left), (bottom, right) = grid[:, 0, 0].tolist(), grid[:, -1, -1].tolist()
    return [round(top, 1), round(min(left, right), 1), round(bottom, 1), round(max(left, right), 1), left > right]


def describe(case):
    per_rank_seed, workers, per_rank_generator = CASES[case]
    return f"manual_seed({'seed + rank' if per_rank_seed else 'seed'}), num_workers={workers}" + (
        ", generator(seed + rank)" if per_rank_generator else ""
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--cases", type=lessonlib.comma_list(choices=list(CASES)), default=",".join(CASES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--images", type=int, default=16, choices=range(4, 257), metavar="4..256")
    parser.add_argument("--batch-size", type=int, default=4, choices=range(1, 65), metavar="1..64")
    args = parser.parse_args()
    ctx = lessonlib.setup(device="cpu")  # the images and crops stay on the CPU: gloo, GPUs or not
    n, r = ctx.world_size, ctx.rank

    for case in args.cases:
        mine = crops(case, args.seed, ctx, args.images, args.batch_size)
        every = [torch.empty_like(mine) for _ in range(n)]  # same shape: DistributedSampler pads
        dist.all_gather(every, mine)
        same = [all(torch.equal(g[k], every[0][k]) for g in every) for k in range(len(mine))]
        fraction = sum(same) / len(same) if n > 1 else None  # one rank: nothing to compare with
        if n > 1 and case in SAME:
            assert fraction == 1.0, f"rank {r}: case {case}: only {fraction:.0%} of crops identical across ranks"
        elif n > 1:
            assert fraction < 0.2, f"rank {r}: case {case}: {fraction:.0%} of crops identical across ranks"
        lessonlib.report(
            "crops",
            {
                "case": case,
                "setup": describe(case),
                "identical fraction": fraction,
                "samples": len(mine),
                "boxes": [box(g) for g in mine[:4]],
            },
        )
        if ctx.is_main:
            shown = "n/a (one rank)" if fraction is None else f"{fraction:4.0%}"
            print(f"{case}  {describe(case):45} crops identical across ranks: {shown}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
