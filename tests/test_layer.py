"""KDALayer: every mode against an independent float64 recomputation, verify+commit against
plain decode, and tensor-parallel shards against the unsharded layer."""
import pytest
import torch
import torch.nn.functional as F

from helpers import rel_err
from kdakit.layer import KDALayer
from kdakit.state_pool import PAD, StatePool

HIDDEN, H, HV, K, V = 32, 2, 4, 16, 24  # grouped value heads and K != V


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls: intra-op threads only add synchronisation (40x slower on 2-core CI)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_layer(lower_bound=None, seed=0, **kw):
    layer = KDALayer(HIDDEN, kw.pop("num_heads", H), K, V, num_v_heads=kw.pop("num_v_heads", HV),
                     lower_bound=lower_bound, **kw)
    layer.reset_parameters(torch.Generator().manual_seed(seed))
    with torch.no_grad():  # a non-trivial output-norm weight
        layer.o_norm_weight.copy_(torch.rand(V, generator=torch.Generator().manual_seed(seed + 1)) + 0.5)
    return layer


def make_pool(layer, slots=4, spec=None, num_spec=0, scratch_rows=None):
    return StatePool(1, slots, num_heads=layer.H, num_v_heads=layer.HV, head_k_dim=K, head_v_dim=V,
                     act_dtype=torch.float32, spec=spec, num_spec=num_spec, scratch_rows=scratch_rows)


def naive_layer(layer, x):
    """The layer over a whole sequence ``x [T, hidden]`` from a zero state, in float64, written
    from the math of docs/design.md alone (no kdakit code)."""
    p = {n: t.detach().double() for n, t in layer.named_parameters()}
    x = x.double()
    Hl, HVl, W = layer.H, layer.HV, layer.conv_width
    T = x.shape[0]
    qkv = torch.cat([x @ p["q_proj.weight"].T, x @ p["k_proj.weight"].T, x @ p["v_proj.weight"].T], -1)
    padded = torch.cat([qkv.new_zeros(W - 1, qkv.shape[1]), qkv])
    conv = F.silu(sum(p["conv_weight"][:, j] * padded[j:j + T] for j in range(W)))
    q, k, v = torch.split(conv, [Hl * K, Hl * K, HVl * V], -1)
    a = (x @ p["f_a_proj.weight"].T @ p["f_b_proj.weight"].T).view(T, HVl, K) + p["dt_bias"].view(HVl, K)
    beta = torch.sigmoid(x @ p["b_proj.weight"].T)
    gate = (x @ p["g_a_proj.weight"].T @ p["g_b_proj.weight"].T).view(T, HVl, V)
    A = torch.exp(p["A_log"])[:, None]
    g = -A * F.softplus(a) if layer.lower_bound is None else layer.lower_bound * torch.sigmoid(A * a)
    S = torch.zeros(HVl, V, K, dtype=torch.float64)
    outs = []
    for t in range(T):
        qt = q[t].view(Hl, K).repeat_interleave(HVl // Hl, 0)
        kt = k[t].view(Hl, K).repeat_interleave(HVl // Hl, 0)
        qt = qt / torch.sqrt((qt * qt).sum(-1, keepdim=True) + 1e-6) * K ** -0.5
        kt = kt / torch.sqrt((kt * kt).sum(-1, keepdim=True) + 1e-6)
        S = S * torch.exp(g[t])[:, None, :]
        u = beta[t][:, None] * (v[t].view(HVl, V) - torch.einsum("hvk,hk->hv", S, kt))
        S = S + u[:, :, None] * kt[:, None, :]
        o = torch.einsum("hvk,hk->hv", S, qt)
        o = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + layer.norm_eps) * p["o_norm_weight"] * torch.sigmoid(gate[t])
        outs.append(o.reshape(-1) @ p["o_proj.weight"].T)
    return torch.stack(outs), S


@pytest.mark.parametrize("lower_bound", [None, -3.0])
@torch.no_grad()
def test_prefill_then_decode_matches_float64(lower_bound):
    layer = make_layer(lower_bound)
    x = torch.randn(13, HIDDEN, generator=torch.Generator().manual_seed(1))
    ref, ref_state = naive_layer(layer, x)
    pool = make_pool(layer)
    pool.alloc()
    slot = pool.alloc()  # slot 1: a slot other than 0
    layer.attach(pool, 0)
    outs = [layer.prefill(x[:5], slot), layer.prefill(x[5:8], slot)]  # a chunked prefill continues
    outs += [layer.decode(x[t:t + 1], [slot]) for t in range(8, 13)]
    assert rel_err(torch.cat(outs), ref) < 1e-5
    assert rel_err(pool.state[0, slot], ref_state) < 1e-5
    assert bool((pool.state[0, 0] == 0).all()) and bool((pool.conv[0, 0] == 0).all())


@torch.no_grad()
def test_varlen_prefill_and_batched_decode_with_padding():
    layer = make_layer()
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, HIDDEN, generator=gen) for n in (6, 9)]
    steps = torch.randn(3, 2, HIDDEN, generator=gen)
    pool = make_pool(layer)
    slots = [pool.alloc() for _ in range(3)][1:]  # slots 1, 2
    layer.attach(pool, 0)
    y = layer.prefill(torch.cat(xs), slots, cu_seqlens=[0, 6, 15])
    dec = [layer.decode(torch.cat([steps[i], torch.randn(1, HIDDEN)]), [slots[0], slots[1], PAD])
           for i in range(3)]
    for n in range(2):
        ref, _ = naive_layer(layer, torch.cat([xs[n], steps[:, n]]))
        got = torch.cat([y[[0, 6][n]:[6, 15][n]]] + [d[n:n + 1] for d in dec])
        assert rel_err(got, ref) < 1e-5
    assert all(bool((d[2] == 0).all()) for d in dec), "a padding row must give a zero output"
    assert bool((pool.state[0, [0, 3]] == 0).all())


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("path", ["chunk", "recurrent"])
@torch.no_grad()
def test_prefill_paths_match_float64(path, backend, monkeypatch):
    """Both forwards prefill takes (chunked for long prompts, token by token for short extends)
    give the float64 layer; a prompt longer than a chunk and one shorter, continuing."""
    monkeypatch.setenv("KDAKIT_BACKEND", backend)
    layer = make_layer(-3.0 if path == "chunk" else None, seed=3)
    layer.prefill_chunk_from = 1 if path == "chunk" else 10 ** 9
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(n, HIDDEN, generator=gen) for n in (70, 5)]
    pool = make_pool(layer)
    slots = [pool.alloc() for _ in range(3)][1:]
    layer.attach(pool, 0)
    y = layer.prefill(torch.cat(xs), slots, cu_seqlens=[0, 70, 75])
    for n, (lo, hi) in enumerate(((0, 70), (70, 75))):
        ref, ref_state = naive_layer(layer, xs[n])
        assert rel_err(y[lo:hi], ref) < 1e-5
        assert rel_err(pool.state[0, slots[n]], ref_state) < 1e-5
    assert bool((pool.state[0, [0, 3]] == 0).all()), "slots outside the batch must stay untouched"


@pytest.mark.parametrize("spec", ["snapshot", "ring"])
@torch.no_grad()
def test_verify_commit_equals_plain_decode(spec):
    """Two requests, rounds of 1 + num_spec tokens with varying accept lengths (0 included):
    the verify outputs of every accepted step, and the states and windows after each commit,
    equal plain decoding of the same tokens."""
    num_spec, T = 3, 4
    layer = make_layer(-2.0)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randn(5, HIDDEN, generator=gen), torch.randn(7, HIDDEN, generator=gen)]
    stream = torch.randn(2, 40, HIDDEN, generator=gen)  # the tokens each request goes on with
    plain_pool, spec_pool = make_pool(layer, 5), make_pool(layer, 5, spec, num_spec, scratch_rows=3)
    plain_slots = [plain_pool.alloc() for _ in range(2)]
    spec_pool.alloc()
    spec_slots = [spec_pool.alloc() for _ in range(2)]  # different slot numbers than the plain pool
    layer.attach(plain_pool, 0)
    for n in range(2):
        layer.prefill(prompts[n], plain_slots[n])
    plain = torch.stack([layer.decode(stream[:, t], plain_slots) for t in range(40)], 1)  # [2, 40, hidden]
    layer.attach(spec_pool, 0)
    for n in range(2):
        layer.prefill(prompts[n], spec_slots[n])
    pos = [0, 0]
    schedule = [(4, 1), (0, 2), (2, 4), (3, 3), (1, 0), (4, 4), (2, 1)]
    rows = torch.tensor([2, 0, 1], dtype=torch.int32)
    for lens in schedule:
        x = torch.stack([stream[n, pos[n]:pos[n] + T] for n in range(2)] + [torch.randn(T, HIDDEN)])
        slots = torch.tensor(spec_slots + [PAD], dtype=torch.int32)
        before = spec_pool.state.clone()
        out = layer.verify(x, slots, rows)
        assert torch.equal(spec_pool.state, before), "verify must not touch the persistent pool"
        assert bool((out[2] == 0).all())
        for n in range(2):
            assert rel_err(out[n, :lens[n]].reshape(-1), plain[n, pos[n]:pos[n] + lens[n]].reshape(-1)) < 1e-5 \
                if lens[n] else True
        layer.commit(slots, rows, torch.tensor(list(lens) + [0], dtype=torch.int32))
        pos = [p + n for p, n in zip(pos, lens)]
    # Catch the plain run up to the same positions: states and windows agree.
    check_pool = make_pool(layer, 5)
    layer.attach(check_pool, 0)
    for n in range(2):
        s = check_pool.alloc()
        layer.prefill(torch.cat([prompts[n], stream[n, :pos[n]]]), s)
        assert rel_err(spec_pool.state[0, spec_slots[n]], check_pool.state[0, s]) < 1e-5
        assert rel_err(spec_pool.conv[0, spec_slots[n]], check_pool.conv[0, s]) < 1e-6
    assert bool((spec_pool.state[0, 0] == 0).all())


@pytest.mark.parametrize("heads", [(4, 4), (2, 4)])
@torch.no_grad()
def test_tensor_parallel_shards_sum_to_the_full_layer(heads):
    full = make_layer(None, num_heads=heads[0], num_v_heads=heads[1])
    tp = 2
    shards = [KDALayer.shard(full, r, tp) for r in range(tp)]
    assert shards[0].H == heads[0] // tp and shards[0].o_proj.in_features == heads[1] // tp * V
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(4))
    outs = []
    for layer in [full] + shards:
        pool = make_pool(layer, 2)
        slot = pool.alloc()
        layer.attach(pool, 0)
        y = layer.prefill(x[:6], slot)
        outs.append(torch.cat([y] + [layer.decode(x[t:t + 1], [slot]) for t in range(6, 9)]))
    assert rel_err(outs[1] + outs[2], outs[0]) < 1e-5
    with pytest.raises(ValueError, match="tp_size"):
        KDALayer(HIDDEN, 3, K, V, tp_size=2)


def test_errors():
    layer = make_layer()
    with pytest.raises(ValueError, match="no cache"):
        layer.decode(torch.randn(1, HIDDEN), [0])
    pool = make_pool(layer, 2)
    layer.attach(pool, 0)
    with pytest.raises(ValueError, match="speculative buffers"):
        layer.verify(torch.randn(1, 2, HIDDEN), [0], [0])
    with pytest.raises(ValueError, match="do not match"):
        layer.attach(StatePool(1, 2, num_heads=H, head_k_dim=K, head_v_dim=V), 0)
