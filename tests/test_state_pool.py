"""StatePool: layouts, slot hand-out, zeroing, errors, and the views the ops take."""
import pytest
import torch

from kdakit.state_pool import PAD, PoolExhausted, StatePool

DIMS = dict(num_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=24)


def test_shapes_dtypes_and_views():
    pool = StatePool(3, 5, **DIMS, act_dtype=torch.bfloat16)
    H, HV, K, V = 2, 4, 16, 24
    C = 2 * H * K + HV * V
    assert pool.state.shape == (3, 5, HV, V, K) and pool.state.dtype == torch.float32
    assert pool.conv.shape == (3, 5, C, 3) and pool.conv.dtype == torch.bfloat16
    assert pool.snapshots is None and pool.ring_k is None and pool.intermediate_conv is None
    cache = pool.layer(1)
    assert cache.state.shape == (5, HV, V, K) and cache.state.data_ptr() == pool.state[1].data_ptr()
    q, k, v = cache.conv_qkv
    assert (q.shape, k.shape, v.shape) == ((5, H * K, 3), (5, H * K, 3), (5, HV * V, 3))
    v.fill_(7)  # channel views alias the packed pool
    assert bool((pool.conv[1, :, 2 * H * K:] == 7).all()) and bool((pool.conv[1, :, :2 * H * K] == 0).all())
    assert cache.snapshots is None and cache.rings is None
    assert PAD == StatePool.PAD == -1


def test_snapshot_and_ring_buffers():
    snap = StatePool(2, 6, **DIMS, act_dtype=torch.float32, spec="snapshot", num_spec=3, scratch_rows=4)
    assert snap.snapshots.shape == (2, 4, 4, 4, 24, 16) and snap.snapshots.dtype == torch.float32
    assert snap.intermediate_conv.shape == (2, 4, 4, snap.C, 3)
    iq, ik, iv = snap.intermediate_conv_qkv(0)
    assert iq.shape == (4, 4, 32, 3) and iv.shape == (4, 4, 96, 3) and iv.stride()[2:] == (3, 1)
    ring = StatePool(2, 6, **DIMS, act_dtype=torch.bfloat16, spec="ring", num_spec=2)
    rk, rv, rg, rb = ring.rings(1)
    assert rk.shape == (6, 2, 3, 16) and rv.shape == (6, 4, 3, 24) and rg.shape == (6, 4, 3, 16)
    assert rb.shape == (6, 4, 3) and rk.dtype == rv.dtype == torch.bfloat16 and rg.dtype == rb.dtype == torch.float32
    assert ring.snapshots is None and ring.intermediate_conv.shape[1:3] == (6, 3)  # scratch rows default to slots
    with pytest.raises(ValueError, match="num_spec"):
        StatePool(1, 2, **DIMS, spec="ring")
    with pytest.raises(ValueError, match="spec"):
        StatePool(1, 2, **DIMS, spec="rings", num_spec=1)


def test_alloc_free_zeroing_and_errors():
    pool = StatePool(2, 3, **DIMS)
    pool.state.fill_(float("nan"))
    pool.conv.fill_(5)
    a, b = pool.alloc(), pool.alloc()
    assert (a, b) == (0, 1) and pool.num_free == 1 and pool.in_use == [0, 1]
    for s in (a, b):
        assert bool((pool.state[:, s] == 0).all()) and bool((pool.conv[:, s] == 0).all())
    assert bool(pool.state[:, 2].isnan().all()), "alloc touched a slot it did not hand out"
    c = pool.alloc()
    with pytest.raises(PoolExhausted):
        pool.alloc()
    pool.free(b)
    with pytest.raises(ValueError, match="double free"):
        pool.free(b)
    with pytest.raises(ValueError, match="not a slot"):
        pool.free(PAD)
    with pytest.raises(ValueError, match="not a slot"):
        pool.free(3)
    pool.state[:, b] = 1.0
    assert pool.alloc() == b and bool((pool.state[:, b] == 0).all())
    assert pool.in_use == [a, b, c]
    assert "StatePool(layers=2" in repr(pool)
