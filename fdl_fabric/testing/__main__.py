"""``python -m fdl_fabric.testing slurm DIR [N_NODES]``: keep a Slurm lab up by hand.

Run through the package (not ``-m fdl_fabric.testing.slurm``), which the package's own
imports would load twice.
"""

import sys

from .slurm import main

if sys.argv[1:2] != ["slurm"]:
    print("usage: python -m fdl_fabric.testing slurm DIR [N_NODES]", file=sys.stderr)
    sys.exit(2)
sys.exit(main(sys.argv[2:]))
