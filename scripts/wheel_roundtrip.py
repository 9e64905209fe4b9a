"""Installed-package smoke test (scripts/wheel_check.sh runs it in a fresh venv, outside the checkout).

Two gloo ranks (torch.multiprocessing spawn), torch backend: dispatch -> identity expert -> combine must
give U * x exactly, U[t] = the number of distinct destination ranks of token t, and the combined weights
U * w. Also checks that the imports come from the installed package, not a checkout.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, TOKENS, HIDDEN, EXPERTS_PER_RANK, TOP_K = 2, 24, 128, 4, 3


def rank_main(rank: int, init_file: str) -> None:
    import runtime
    from runtime import EpDispatchCombineConfig, EpDispatchCombineOp

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        cfg = EpDispatchCombineConfig(rank=rank, world_size=WORLD, hidden_dim=HIDDEN,
                                      max_num_inp_token_per_rank=TOKENS, num_experts_per_rank=EXPERTS_PER_RANK,
                                      num_experts_per_token=TOP_K, kernel_backend="torch")
        op = EpDispatchCombineOp(cfg)
        gen = torch.Generator().manual_seed(1234 + rank)
        x = torch.randn(TOKENS, HIDDEN, generator=gen).to(torch.bfloat16)
        w = torch.rand(TOKENS, TOP_K, generator=gen)
        idx = torch.randint(0, WORLD * EXPERTS_PER_RANK, (TOKENS, TOP_K), generator=gen, dtype=torch.int32)
        out, out_w, _, _, total, handle = op.dispatch(x, w, None, idx, return_routing=True)
        n = int(total[0])
        combined, combined_w = op.combine(out[:n], out_w[:n], None, routing=handle)  # identity expert
        dest = idx.long() // EXPERTS_PER_RANK
        u = torch.tensor([len(set(row.tolist())) for row in dest], dtype=torch.float32)[:, None]
        assert torch.equal(combined, (u * x.float()).to(torch.bfloat16)), f"rank {rank}: combine != U*x"
        assert torch.equal(combined_w, u * w), f"rank {rank}: combined weights != U*w"
        op.close()
        print(f"rank {rank}: {n} rows received, combine == U*x for {TOKENS} tokens ({runtime.__file__})", flush=True)
    finally:
        dist.destroy_process_group()


def main() -> int:
    import generator
    import runtime

    here = os.path.abspath(os.getcwd())
    for mod in (generator, runtime):
        if "site-packages" not in mod.__file__:
            print(f"error: {mod.__name__} imported from {mod.__file__}, not an installed package", file=sys.stderr)
            return 1
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(os.path.join(tmp, "rendezvous"),), nprocs=WORLD, join=True)
    print(f"round trip ok (cwd {here})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
