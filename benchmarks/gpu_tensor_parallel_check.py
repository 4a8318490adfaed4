"""The tensor-parallel KDA layer over NCCL: two ranks, one GPU each, against the unsharded layer.

Run on a host with two GPUs (the device tool's notes ask for NVLink multicast off):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
        torchrun --standalone --nproc-per-node 2 benchmarks/gpu_tensor_parallel_check.py [--out DIR]

Every rank builds the same unsharded ``KDALayer`` from one seed on its GPU, cuts its shard with
``KDALayer.shard(full, rank, 2)`` and runs both on the same inputs: a varlen prefill past one
64-token chunk (so the chunked prefill runs), decode steps with a padding row, speculative
verify and commit (snapshot and ring pools, each gate), decode again. The shards' ``o_proj``
partial sums, all-reduced over NCCL, must equal the full layer's outputs within float32
rounding, and after every commit each shard's slots must hold the full layer's states of its
value heads and conv windows of its channels. Float32 activations (float32-level products in
every kernel). Rank 0 writes ``tensor_parallel_check_<gpu>.json`` (GPU names, errors, ok) to
``--out`` (default ``$OUT`` or benchmarks/results/); the exit code is 0 only when every error is
below the tolerance on every rank.

``--device cpu --backend gloo`` runs the same script on two CPU processes (the PyTorch
reference backend): how its logic is checked on a machine without GPUs.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kdakit.layer import KDALayer  # noqa: E402
from kdakit.state_pool import PAD, StatePool  # noqa: E402

TP = 2
TOL = 1e-4  # float32 rounding of a layer's sums over its heads, at these sizes
HIDDEN, H, HV, K, V = 512, 4, 8, 128, 64  # grouped value heads and K != V (a transposed layout fails)


def rel(x, ref):
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def shard_rows(rank, device):
    """Index tensors of this shard's value heads (state) and conv channels (q | k | v windows)."""
    h, hv = H // TP, HV // TP
    hk = torch.arange(rank * h * K, (rank + 1) * h * K, device=device)
    heads = torch.arange(rank * hv, (rank + 1) * hv, device=device)
    channels = torch.cat([hk, H * K + hk, 2 * H * K + torch.arange(rank * hv * V, (rank + 1) * hv * V,
                                                                     device=device)])
    return heads, channels


def run_case(rank, device, spec, lower_bound, errs):
    num_spec, T = 3, 4
    full = KDALayer(HIDDEN, H, K, V, num_v_heads=HV, lower_bound=lower_bound)
    full.reset_parameters(torch.Generator().manual_seed(11))
    with torch.no_grad():
        full.o_norm_weight.copy_(torch.rand(V, generator=torch.Generator().manual_seed(12)) + 0.5)
    full = full.to(device)
    shard = KDALayer.shard(full, rank, TP).to(device)
    pools = {}
    for name, layer in (("full", full), ("shard", shard)):
        pools[name] = pool = StatePool(1, 6, num_heads=layer.H, num_v_heads=layer.HV, head_k_dim=K, head_v_dim=V,
                                       act_dtype=torch.float32, device=device, spec=spec, num_spec=num_spec,
                                       scratch_rows=3)
        layer.attach(pool, 0)
        pool.alloc()  # slot 0 stays unused: the requests sit in slots 1 and 2
    slots = [pools["full"].alloc(), pools["full"].alloc()]
    assert [pools["shard"].alloc(), pools["shard"].alloc()] == slots
    heads, channels = shard_rows(rank, device)
    gen = torch.Generator().manual_seed(13)  # the same inputs on every rank
    tag = f"{spec}/lb={lower_bound}"

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    def compare(what, fn):
        ref = fn(full)
        summed = fn(shard).clone()
        dist.all_reduce(summed)  # the engine's all-reduce of the row-parallel o_proj
        errs[f"{tag}/{what}"] = rel(summed, ref)
        return ref

    def compare_pools(what):
        fp, sp = pools["full"], pools["shard"]
        errs[f"{tag}/{what}/state"] = rel(sp.state[0, slots], fp.state[0, slots][:, heads])
        errs[f"{tag}/{what}/conv"] = rel(sp.conv[0, slots], fp.conv[0, slots][:, channels])

    prompts = rnd(150, HIDDEN)  # 70 + 80 tokens: both sequences past one chunk
    compare("prefill", lambda layer: layer.prefill(prompts, slots, cu_seqlens=[0, 70, 150]))
    compare_pools("prefill")
    batch = torch.tensor(slots + [PAD], dtype=torch.int32, device=device)
    for t in range(2):
        x = rnd(3, HIDDEN)
        out = compare(f"decode{t}", lambda layer: layer.decode(x, batch))
        errs[f"{tag}/decode{t}/padding_row_max"] = float(out[2].abs().max())
    compare_pools("decode")
    rows = torch.tensor([2, 0, 1], dtype=torch.int32, device=device)
    for r, lens in enumerate([(4, 1), (0, 2), (2, 4), (3, 0)]):
        x = rnd(3, T, HIDDEN)
        compare(f"verify{r}", lambda layer: layer.verify(x, batch, rows))
        accept = torch.tensor(list(lens) + [0], dtype=torch.int32, device=device)
        for layer in (full, shard):
            layer.commit(batch, rows, accept)
        compare_pools(f"commit{r}")
    x = rnd(3, HIDDEN)
    compare("decode_after_commit", lambda layer: layer.decode(x, batch))
    compare_pools("end")
    digest = torch.stack([pools["full"].state.double().sum(), pools["full"].conv.double().sum()])
    gathered = [torch.empty_like(digest) for _ in range(TP)]
    dist.all_gather(gathered, digest)
    errs[f"{tag}/ranks_agree"] = float(max((g - digest).abs().max() for g in gathered))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--backend", default=None, help="nccl (default on cuda) or gloo")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if args.device == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    if dist.get_world_size() != TP:
        raise SystemExit(f"run with {TP} ranks (torchrun --nproc-per-node {TP})")
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        gpu = torch.cuda.get_device_name(device)
    else:
        device, gpu = torch.device("cpu"), "cpu"
    errs = {}
    with torch.no_grad():
        for spec, lower_bound in (("snapshot", None), ("ring", -2.0), ("snapshot", -5.0), ("ring", None)):
            run_case(rank, device, spec, lower_bound, errs)
    bad = {k: v for k, v in errs.items() if not v < TOL}
    names = [None] * TP
    dist.all_gather_object(names, {"rank": rank, "gpu": gpu, "bad": bad, "max_err": max(errs.values())})
    if rank == 0:
        ok = all(not n["bad"] for n in names)
        result = {"env": {"gpus": [n["gpu"] for n in names], "torch": torch.__version__, "backend": backend,
                          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                          "command": " ".join(["torchrun --nproc-per-node 2"] + sys.argv)},
                  "tolerance": TOL, "ranks": names, "errors_rank0": errs, "ok": ok}
        tag = next((m.lower() for m in ("H100", "H200") if m in gpu), args.device)
        folder = args.out or os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"tensor_parallel_check_{tag}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"{len(errs)} checks per rank, max error {max(n['max_err'] for n in names):.2e} "
              f"(tolerance {TOL:g}); ok={ok}; JSON: {path}")
    ok = not bad
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
