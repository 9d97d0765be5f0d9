"""Real PyTorch DistributedDataParallel on CPU (gloo), launched by fdl-fabric.

torch.distributed reads the torchrun-compatible environment the launcher
sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); the rank client joins the
cohort so the launcher knows when the cohort formed and can tell survivors to
save and stop. At the end every rank prints a fingerprint of its parameters:
with DDP they must be identical on every rank.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

try:
    from fdl_fabric import rank as cohort
except ImportError:  # running from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from fdl_fabric import rank as cohort


def fingerprint(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="", help="folder for params-r<rank>.json")
    parser.add_argument("--dump-env", default="",
                        help="folder for env-r<rank>.json: the environment this rank got")
    args = parser.parse_args()
    if args.dump_env:
        Path(args.dump_env).mkdir(parents=True, exist_ok=True)
        Path(args.dump_env, f"env-r{os.environ.get('RANK', 'x')}.json").write_text(
            json.dumps(dict(os.environ)))

    if cohort.is_launched():
        cohort.join()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)  # different data per rank; DDP syncs the model
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    torch.manual_seed(0)
    for p in model.parameters():  # same start everywhere (DDP broadcasts it anyway)
        nn.init.normal_(p, std=0.1)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(1, args.steps + 1):
        if cohort.is_launched() and cohort.should_stop():
            print(f"stop requested at step {step}", flush=True)
            break
        x = torch.randn(32, 8, generator=gen)
        y = x.sum(dim=1, keepdim=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 5 == 0 or step == args.steps:
            print(f"step {step}/{args.steps} loss={loss.item():.4f}", flush=True)
    fp = fingerprint(model)
    prints = [None] * world
    dist.all_gather_object(prints, fp)
    agree = len(set(prints)) == 1
    print(f"params fingerprint {fp}; ranks agree: {agree}", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, f"params-r{rank}.json").write_text(
            json.dumps({"rank": rank, "fingerprint": fp, "all": prints}))
    dist.destroy_process_group()
    return 0 if agree else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
