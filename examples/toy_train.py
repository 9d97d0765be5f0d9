"""A tiny standard-library "trainer": the default job of cluster.yml.

It reads the torchrun-compatible environment the launcher sets, runs a few
steps of a fake optimisation and prints progress, so a first `inv launch`
shows what a real run looks like without installing anything.
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--step-time", type=float, default=0.2)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    print(f"rank {rank}/{world} on {os.environ.get('FLODL_HOST_NAME')} "
          f"(master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']})", flush=True)
    weight = 1.0
    for step in range(1, args.steps + 1):
        weight -= 0.1 * (weight - 0.5)
        time.sleep(args.step_time)
        print(f"step {step}/{args.steps} loss={abs(weight - 0.5):.4f}", flush=True)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
