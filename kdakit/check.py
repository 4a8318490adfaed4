"""`kdakit check`: every backend available on this machine against the float64 reference.

Each op has a case builder (small random inputs on the device at hand) and a
runner per backend; the table shows the relative error of the outputs and of
the updated pools, and whether unused pool slots stayed bitwise.
"""
from __future__ import annotations

import importlib.util
import os

import torch

import kdakit

from . import backends, reference
from .bench import inputs


def available_backends(device: torch.device) -> list[str]:
    names = ["reference"]
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        names.append("triton")
    if importlib.util.find_spec("helion") is not None and (
            device.type == "cuda" or os.environ.get("HELION_INTERPRET") == "1"):
        names.append("helion")
    return names


def _rel(x, y) -> float:
    x, y = x.double(), y.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x - y).norm() / y.norm().clamp_min(1e-30))


class _Case:
    """Small random inputs for one check, on the device at hand, float32 (float64 for the oracle)."""

    def __init__(self, device, seed=0, H=2, HV=4, K=32, V=48, slots=9):
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.device, self.H, self.HV, self.K, self.V, self.slots = device, H, HV, K, V, slots
        self.A_log = torch.rand(HV, generator=self.gen).to(device)
        self.dt_bias = self.rnd(HV * K) * 0.5
        self.state = self.rnd(slots, HV, V, K) * 0.5
        self.idx = torch.tensor([7, -1, 2, 4], dtype=torch.int32, device=device)

    def rnd(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(self.device)

    def unused(self):
        live = set(int(s) for s in self.idx.tolist() if s >= 0)
        return [s for s in range(self.slots) if s not in live]


def _f64(t):
    return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


# The sizes of every check: small grouped heads, K and V off the powers of two, a pool of 9
# slots with one padding row (the inputs builders of kdakit/bench/inputs.py, float32).
SIZES = dict(H=2, HV=4, K=32, V=48)
SLOTS = 9
IDX = (7, -1, 2, 4)
F32 = dict(state_dtype=torch.float32, act_dtype=torch.float32)


def _index(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _unused(idx, slots=SLOTS):
    live = set(int(s) for s in idx.tolist() if s >= 0)
    return [s for s in range(slots) if s not in live]


def check_packed_decode(backend, device):
    L = inputs.packed_decode_inputs(len(IDX), *SIZES.values(), slots=SLOTS, seed=0, device=device, **F32)
    L["idx"] = _index(IDX, device)
    before, ref_state = L["state"].clone(), L["state"].double()
    ref_out = torch.empty(L["out"].shape, dtype=torch.float64, device=device)
    reference.packed_decode(*(L[n].double() for n in ("mixed", "a", "b", "A_log", "dt_bias")), ref_state, L["idx"],
                            ref_out, lower_bound=-2.0, compute_dtype=torch.float64)
    out = L["out"].fill_(float("nan"))
    kdakit.packed_decode(L["mixed"], L["a"], L["b"], L["A_log"], L["dt_bias"], L["state"], L["idx"], out,
                         lower_bound=-2.0, backend=backend)
    u = _unused(L["idx"])
    return {"out_err": _rel(out, ref_out), "pool_err": _rel(L["state"], ref_state),
            "untouched": bool(torch.equal(L["state"][u], before[u]))}


def check_fused_decode(backend, device):
    L = inputs.fused_decode_inputs(len(IDX), *SIZES.values(), conv_dtype=torch.float32, transposed_conv=False,
                                   slots=SLOTS, seed=1, device=device, **F32)
    L["idx"] = _index(IDX, device)
    conv = L["conv_state"]
    before, ref_state, ref_conv = L["state"].clone(), L["state"].double(), conv.double()
    ref_out = torch.empty(L["out"].shape, dtype=torch.float64, device=device)
    reference.fused_decode(L["qkv"].double(), L["conv_weight"].double(), ref_conv,
                           *(L[n].double() for n in ("a", "b", "A_log", "dt_bias")), ref_state, L["idx"], ref_out,
                           norm_gate=L["norm_gate"].double(), norm_weight=L["norm_weight"].double(),
                           compute_dtype=torch.float64)
    out = kdakit.fused_decode(L["qkv"], L["conv_weight"], conv, L["a"], L["b"], L["A_log"], L["dt_bias"], L["state"],
                              L["idx"], norm_gate=L["norm_gate"], norm_weight=L["norm_weight"], backend=backend)
    u = _unused(L["idx"])
    return {"out_err": _rel(out, ref_out), "pool_err": max(_rel(L["state"], ref_state), _rel(conv, ref_conv)),
            "untouched": bool(torch.equal(L["state"][u], before[u]))}


def check_mtp_verify_and_commit(backend, device):
    """Ring verify + ring commit against the reference; the pools stay read-only in verify."""
    L = inputs.mtp_verify_inputs(len(IDX), 3, *SIZES.values(), conv=False, mode="ring", slots=SLOTS,
                                 act_dtype=torch.float32, state_scale=0.5, seed=2, device=device)
    L["slots"], L["scratch_idx"] = _index(IDX, device), _index((0, 1, 2, 3), device)
    my_rings = L["rings"]
    ref_rings = tuple(torch.zeros_like(r, dtype=torch.float64) for r in my_rings)
    ref_out = torch.empty(L["out"].shape, dtype=torch.float64, device=device)
    tokens = [L[n] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias")]
    reference.mtp_verify(*map(_f64, tokens), L["state"].double(), L["slots"], L["scratch_idx"], ref_out,
                         rings=ref_rings, compute_dtype=torch.float64)
    before = L["state"].clone()
    out = kdakit.mtp_verify(*tokens, L["state"], L["slots"], L["scratch_idx"], rings=my_rings, backend=backend)
    read_only = bool(torch.equal(L["state"], before))
    accept = torch.tensor([2, 0, 3, 1], dtype=torch.int32, device=device)
    ref_state = L["state"].double()
    reference.commit_ring(ref_state, *ref_rings, L["slots"], accept, compute_dtype=torch.float64)
    kdakit.commit_ring(L["state"], *my_rings, L["slots"], accept, backend=backend)
    u = _unused(L["slots"])
    return {"out_err": _rel(out, ref_out), "pool_err": _rel(L["state"], ref_state),
            "untouched": read_only and bool(torch.equal(L["state"][u], before[u]))}


def _check_varlen(op, backend, device, seqlens, idx, seed):
    """``op`` (recurrent_forward or chunk_prefill) on sequences of ``seqlens`` in slots ``idx``."""
    L = inputs.varlen_inputs(seqlens, *SIZES.values(), slots=SLOTS, seed=seed, device=device, **F32)
    L["idx"] = _index(idx, device)
    before, ref_state = L["state"].clone(), L["state"].double()
    ref_out = torch.empty(L["out"].shape, dtype=torch.float64, device=device)
    tokens = [L[n] for n in ("q", "k", "v", "g", "beta")]
    getattr(reference, op)(*map(_f64, tokens), ref_state, L["idx"], ref_out, cu_seqlens=L["cu"],
                           A_log=L["A_log"].double(), dt_bias=L["dt_bias"].double(), beta_is_logit=True,
                           compute_dtype=torch.float64)
    out = getattr(kdakit, op)(*tokens, L["state"], L["idx"], cu_seqlens=L["cu"], A_log=L["A_log"],
                              dt_bias=L["dt_bias"], beta_is_logit=True, backend=backend)
    u = _unused(L["idx"])
    return {"out_err": _rel(out, ref_out), "pool_err": _rel(L["state"], ref_state),
            "untouched": bool(torch.equal(L["state"][u], before[u]))}


def check_recurrent_forward(backend, device):
    return _check_varlen("recurrent_forward", backend, device, (3, 1, 3, 2), (7, 0, 2, 4), seed=3)


def check_causal_conv1d_varlen(backend, device):
    """Unequal sequences (one token, shorter than the window), a padding sequence, one without an
    initial state, the pool as sglang's transposed [slots, W-1, C] view."""
    c = _Case(device, seed=4)
    C, W, T = 48, 4, 12
    x, weight = c.rnd(T, C), c.rnd(C, W) * 0.5
    conv = c.rnd(c.slots, W - 1, C).transpose(1, 2)
    cu = torch.tensor([0, 1, 3, 9, 12], dtype=torch.int32, device=device)
    flags = torch.tensor([True, True, True, False], device=device)
    before, ref_conv = conv.clone(), conv.double()
    ref_out = torch.empty(T, C, dtype=torch.float64, device=device)
    reference.causal_conv1d_varlen(x.double(), ref_conv, weight.double(), cu, c.idx, ref_out, has_initial_state=flags,
                                   compute_dtype=torch.float64)
    out = kdakit.causal_conv1d_varlen(x, conv, weight, cu, c.idx, has_initial_state=flags, backend=backend)
    u = c.unused()
    return {"out_err": _rel(out, ref_out), "pool_err": _rel(conv, ref_conv),
            "untouched": bool(torch.equal(conv[u], before[u]))}


def check_chunk_prefill(backend, device):
    # length 1, off the chunk grid, empty, and a padding slot
    return _check_varlen("chunk_prefill", backend, device, (1, 36, 0, 33), (7, 0, -1, 4), seed=4)


def _check_engine_size(op, act_dtype):
    """``op`` at engine head sizes on the GPU (H = HV = 32, K = V = 128; one 2048-token sequence
    and one of 100 from a live slot, a padding row) on long-memory inputs (the state carries
    across every chunk), against the float64 reference: what the small cases cannot reach
    (the configs picked for real sizes, bf16 factors and products, the chunk chain)."""
    def check(backend, device):
        L = inputs.varlen_inputs([2048, 100, 0], 32, 32, 128, 128, act_dtype=act_dtype, long_memory=True, seed=5,
                                 device=device)
        L["idx"][2] = -1
        before, ref_state = L["state"].clone(), L["state"].double()
        ref_out = torch.zeros(L["out"].shape, dtype=torch.float64, device=device)
        tokens = [L[n] for n in ("q", "k", "v", "g", "beta")]
        reference.recurrent_forward(*map(_f64, tokens), ref_state, L["idx"], ref_out, cu_seqlens=L["cu"],
                                    A_log=L["A_log"].double(), dt_bias=L["dt_bias"].double(), beta_is_logit=True,
                                    compute_dtype=torch.float64)
        out = getattr(kdakit, op)(*tokens, L["state"], L["idx"], cu_seqlens=L["cu"], A_log=L["A_log"],
                                  dt_bias=L["dt_bias"], beta_is_logit=True, backend=backend)
        live = L["idx"][:2].long()
        unused = torch.ones(L["state"].shape[0], dtype=torch.bool, device=device)
        unused[live] = False
        return {"out_err": _rel(out, ref_out), "pool_err": _rel(L["state"][live], ref_state[live]),
                "untouched": bool(torch.equal(L["state"][unused], before[unused]))}
    check.gpu_only = True
    # float32 inputs: float32-level results; bf16 inputs: outputs rounded to bf16 (~4e-3) and
    # the chunked prefill's bf16 factors and products, as fla's chunk_kda (1e-2 or better)
    check.tolerance = 1e-4 if act_dtype == torch.float32 else 2e-2
    return check


CHECKS = {"packed_decode": check_packed_decode, "fused_decode": check_fused_decode,
          "mtp_verify+commit_ring": check_mtp_verify_and_commit, "recurrent_forward": check_recurrent_forward,
          "causal_conv1d_varlen": check_causal_conv1d_varlen, "chunk_prefill": check_chunk_prefill}
REGISTRY_NAME = {"mtp_verify+commit_ring": "mtp_verify"}
for _op in ("chunk_prefill", "recurrent_forward"):
    for _name, _dtype in (("float32", torch.float32), ("bf16", torch.bfloat16)):
        CHECKS[f"{_op} 2k H32 {_name}"] = _check_engine_size(_op, _dtype)
        REGISTRY_NAME[f"{_op} 2k H32 {_name}"] = _op


def run(device: str | None = None) -> list[dict]:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    for op, check in CHECKS.items():
        if getattr(check, "gpu_only", False) and dev.type != "cuda":
            continue  # engine sizes: too slow for the interpreter
        tol = getattr(check, "tolerance", 1e-4)
        for backend in available_backends(dev):
            if backend not in backends.available(REGISTRY_NAME.get(op, op)):
                continue
            try:
                result = check(backend, dev)
                ok = result["out_err"] < tol and result["pool_err"] < tol and result["untouched"]
                rows.append({"op": op, "backend": backend, **result, "ok": ok})
            except Exception as exc:  # report, don't hide: the table says what failed
                rows.append({"op": op, "backend": backend, "error": f"{type(exc).__name__}: {exc}", "ok": False})
    return rows


def main(device: str | None = None) -> int:
    rows = run(device)
    print(f"{'op':24s} {'backend':10s} {'out err':>10s} {'pool err':>10s} {'untouched':>9s}  ok")
    for r in rows:
        if "error" in r:
            print(f"{r['op']:24s} {r['backend']:10s} ERROR {r['error']}")
        else:
            print(f"{r['op']:24s} {r['backend']:10s} {r['out_err']:10.2e} {r['pool_err']:10.2e} "
                  f"{str(r['untouched']):>9s}  {'yes' if r['ok'] else 'NO'}")
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)} of {len(rows)} checks agree with the float64 reference"
          + (f"; {len(failed)} do not" if failed else ""))
    return 1 if failed else 0


def check_tree_verify_and_commit(backend, device):
    """Tree verify (snapshot mode) + the commit of an accepted node against the reference."""
    c = _Case(device, seed=4)
    N, T = c.idx.numel(), 5
    q, k = c.rnd(N, T, c.H, c.K), c.rnd(N, T, c.H, c.K)
    v, a, b = c.rnd(N, T, c.HV, c.V), c.rnd(N, T, c.HV, c.K), c.rnd(N, T, c.HV)
    scratch = torch.tensor([3, 0, 1, 2], dtype=torch.int32, device=device)
    parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3], [-1, 0, 1, 1, -1], [-1, 0, 0, 0, 3]],
                           dtype=torch.int32, device=device)
    ref_snaps = torch.zeros(N, T, c.HV, c.V, c.K, dtype=torch.float64, device=device)
    snaps = torch.zeros(N, T, c.HV, c.V, c.K, device=device)
    ref_out = torch.empty(N, T, c.HV, c.V, dtype=torch.float64, device=device)
    reference.tree_verify(*map(_f64, (q, k, v, a, b, c.A_log, c.dt_bias)), c.state.double(), c.idx, scratch, parents,
                          ref_out, snapshots=ref_snaps, compute_dtype=torch.float64)
    before = c.state.clone()
    out = kdakit.tree_verify(q, k, v, a, b, c.A_log, c.dt_bias, c.state, c.idx, scratch, parents, snapshots=snaps,
                             backend=backend)
    read_only = bool(torch.equal(c.state, before))
    accepted = torch.tensor([3, 0, 4, 2], dtype=torch.int32, device=device)
    ref_state = c.state.double()
    reference.commit_snapshots(ref_state, ref_snaps, c.idx, scratch, accepted)
    kdakit.commit_snapshots(c.state, snaps, c.idx, scratch, accepted, backend=backend)
    u = c.unused()
    return {"out_err": _rel(out, ref_out), "pool_err": _rel(c.state, ref_state),
            "untouched": read_only and bool(torch.equal(c.state[u], before[u]))}


CHECKS["tree_verify+commit_snapshots"] = check_tree_verify_and_commit
REGISTRY_NAME["tree_verify+commit_snapshots"] = "tree_verify"
