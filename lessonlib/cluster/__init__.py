"""Simulated machines on one Linux machine, for chapters 16 and 17 (root, iproute2; Slurm for chapter 17).

- `hosts`: `Hosts`, several hosts made of network namespaces on one switch, to launch on
  (`lessonlib.launch(..., hosts=net)`) and to run commands on.
- `_netkeeper`: the keeper process that removes a network when its owner is done or dies.
- `slurm`: `Slurm`, a Slurm cluster on such hosts: a login host, compute nodes, real sbatch and srun.

Nothing is imported here: `lessonlib.Hosts` and `lessonlib.Slurm` import their module on first use.
"""
