"""A tiny standard-library "trainer" that uses the rank client: the default job.

It joins the cohort (`fdl_fabric.rank.join()`), runs a step loop that prints
progress, and writes a checkpoint when the coordinator asks for a
save-and-shutdown (max_failure reached) or when training ends. Without a
launcher (no envelope in the environment) it trains alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

try:
    from fdl_fabric import rank as cohort
except ImportError:  # running from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from fdl_fabric import rank as cohort


def save(folder: Path, rank: int, step: int, weight: float, reason: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"checkpoint-r{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rank": rank, "step": step, "weight": weight, "reason": reason}))
    os.replace(tmp, path)
    return path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--step-time", type=float, default=0.2)
    parser.add_argument("--checkpoint-dir", default="checkpoints")
    parser.add_argument("--join-delay-rank", type=int, default=-1,
                        help="this rank waits --join-delay seconds before joining (tests)")
    parser.add_argument("--join-delay", type=float, default=0.0)
    args = parser.parse_args()

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if rank == args.join_delay_rank:
        time.sleep(args.join_delay)
    if cohort.is_launched():
        member = cohort.join()
        print(f"rank {member.rank}/{member.world_size} joined on {member.host} "
              f"(pid {os.getpid()})", flush=True)
    else:
        print(f"rank {rank}/{world} running alone (not launched by fdl-fabric)", flush=True)

    weight, step = 1.0, 0
    folder = Path(args.checkpoint_dir)
    while step < args.steps:
        if cohort.is_launched() and cohort.should_stop():
            path = save(folder, rank, step, weight, "shutdown")
            print(f"shutdown requested: saved {path} at step {step}", flush=True)
            return 0
        step += 1
        weight -= 0.1 * (weight - 0.5)
        time.sleep(args.step_time)
        alive = len(cohort.survivors()) if cohort.is_launched() else world
        print(f"step {step}/{args.steps} loss={abs(weight - 0.5):.4f} "
              f"survivors={alive}/{world}", flush=True)
    path = save(folder, rank, step, weight, "done")
    print(f"done: saved {path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
