"""PyTorch DistributedDataParallel on GPT-2: the peer of fusec's data-parallel training
(issue 15). Run under torchrun, one process per GPU:

    torchrun --standalone --nproc_per_node 2 benches/torch_ddp_bench.py --bench PATH/torch_gpt2_bench.py

Every rank trains the same GPT-2 (the model class of torch_gpt2_bench.py, imported from
--bench) on its own random batch of --batch sequences (the global batch is WORLD_SIZE times
that), bf16 autocast, fused AdamW, DDP's bucketed all-reduce overlapped with the backward
(optionally torch.compile). Rank 0 prints one JSON line: median ms/step, global tokens/s,
peak memory per GPU.
"""
import argparse, importlib.util, json, os, time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True, help="path of torch_gpt2_bench.py (its GPT2 class)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--channels", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--batch", type=int, default=16, help="sequences per GPU")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    spec = importlib.util.spec_from_file_location("torch_gpt2_bench", a.bench)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    model = bench.GPT2(a.vocab, a.seq, a.layers, a.heads, a.channels, False).cuda()
    model = DDP(model, device_ids=[local])
    step_model = torch.compile(model) if a.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True)
    g = torch.Generator(device="cuda").manual_seed(1 + rank)

    def step():
        x = torch.randint(0, a.vocab, (a.batch, a.seq + 1), device="cuda", generator=g)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_model(x[:, :-1].contiguous(), x[:, 1:].contiguous())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(a.warmup + 1):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    med = times[len(times) // 2]
    if rank == 0:
        print(json.dumps({
            "mode": "ddp-compile-bf16" if a.compile else "ddp-eager-bf16", "world": world,
            "L": a.layers, "C": a.channels, "B_per_gpu": a.batch, "T": a.seq,
            "ms_per_step_median": round(med, 2), "tokens_per_s": round(world * a.batch * a.seq / med * 1e3),
            "peak_mem_mib_per_gpu": torch.cuda.max_memory_allocated() // (1 << 20),
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
        }))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
