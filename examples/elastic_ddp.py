"""DDP on CPU (gloo) that survives a change of world size between attempts.

When a host is lost, fdl-fabric may start the next attempt on fewer hosts (or
on spares), so WORLD_SIZE and every RANK can differ from one attempt to the
next. This script shows what a training program needs for that:

- it reads RANK and WORLD_SIZE afresh on every start (nothing is cached across
  attempts), and prints `attempt A rank R/W resumes at step K`;
- rank 0 checkpoints model, optimizer and step atomically after every step, so
  a new attempt loses at most one step; rank 0 reads the checkpoint and
  broadcasts it, so every rank resumes from the same step;
- a DistributedSampler over a synthetic, deterministic TensorDataset shards the
  data by the current world size, with a fixed *global* batch: each rank takes
  global_batch // WORLD_SIZE samples, so one optimizer step sees the same
  samples whatever the world size and the learning rate stays valid.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler, TensorDataset

try:
    from fdl_fabric import rank as cohort
except ImportError:  # running from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from fdl_fabric import rank as cohort

SAMPLES = 240  # 10 global batches of 24 an epoch; 24 divides by 1, 2, 3, 4, 6 and 8 ranks


def fingerprint(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def save(path: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer,
         world: int) -> None:
    """Write the checkpoint atomically: a reader sees the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict(),
                "world": world}, tmp)
    os.replace(tmp, path)


def load(path: Path) -> Optional[dict[str, Any]]:
    """Rank 0 reads the checkpoint, every rank receives the same one."""
    box: list[Optional[dict[str, Any]]] = [None]
    if dist.get_rank() == 0 and path.exists():
        box[0] = torch.load(path, map_location="cpu", weights_only=True)
    dist.broadcast_object_list(box, src=0)
    return box[0]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True, help="total optimizer steps")
    parser.add_argument("--ckpt", required=True, help="checkpoint file on a shared folder")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per step")
    parser.add_argument("--out", default="", help="folder for result-r<rank>.json")
    parser.add_argument("--global-batch", type=int, default=24)
    args = parser.parse_args()

    if cohort.is_launched():
        cohort.join()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()  # this attempt's, never cached
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    torch.manual_seed(0)  # the same start on every rank, in every attempt
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ckpt = Path(args.ckpt)
    state = load(ckpt)
    start = 0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
    print(f"attempt {attempt} rank {rank}/{world} resumes at step {start}", flush=True)
    ddp = DistributedDataParallel(model)

    gen = torch.Generator().manual_seed(42)  # the same dataset on every rank and attempt
    x = torch.randn(SAMPLES, 8, generator=gen)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=7)
    per_rank = max(1, args.global_batch // world)
    per_epoch = max(1, len(sampler) // per_rank)  # batches an epoch: the same for every world

    def finish(step: int, stopped: bool) -> None:
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            Path(args.out, f"result-r{rank}.json").write_text(json.dumps({
                "rank": rank, "world_size": world, "restart_count": int(attempt),
                "start_step": start, "step": step, "stopped": stopped,
                "fingerprint": fingerprint(model)}))

    step, indices, epoch = start, [], -1
    while step < args.steps:
        # Stop together: a rank alone leaving would leave the others in all_reduce.
        stop = torch.tensor([int(cohort.is_launched() and cohort.should_stop())])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            if rank == 0:
                save(ckpt, step, model, opt, world)
            print(f"stop requested: saved at step {step}", flush=True)
            finish(step, stopped=True)
            dist.destroy_process_group()
            return 0
        if step // per_epoch != epoch:  # a new epoch, or the one a resumed run is in
            epoch = step // per_epoch
            sampler.set_epoch(epoch)
            indices = list(sampler)
        b = step % per_epoch
        xb, yb = data[torch.tensor(indices[b * per_rank:(b + 1) * per_rank])]
        loss = nn.functional.mse_loss(ddp(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if rank == 0:
            save(ckpt, step, model, opt, world)
        print(f"step {step}/{args.steps} world {world}", flush=True)
        time.sleep(args.sleep)

    fp = fingerprint(model)
    print(f"done at step {args.steps} on world {world}; fingerprint {fp}", flush=True)
    finish(step, stopped=False)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
