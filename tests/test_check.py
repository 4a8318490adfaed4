"""`kdakit check` (the CLI's table of every backend against the float64 reference)."""
from kdakit import check


def test_every_op_and_backend_agree_with_the_reference_on_cpu():
    rows = check.run("cpu")
    assert {r["backend"] for r in rows} == {"reference", "triton"}  # conftest turns the interpreter on
    cpu_checks = {name for name, fn in check.CHECKS.items() if not getattr(fn, "gpu_only", False)}
    assert {r["op"] for r in rows} == cpu_checks  # the engine-size rows run on a GPU only
    assert len(cpu_checks) < len(check.CHECKS)
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad


def test_a_wrong_kernel_shows_as_a_failed_row(monkeypatch):
    def broken(backend, device):
        result = check.check_packed_decode(backend, device)
        return dict(result, out_err=1.0)
    monkeypatch.setattr(check, "CHECKS", {"packed_decode": broken})
    rows = check.run("cpu")
    assert rows and not any(r["ok"] for r in rows)
    assert check.main("cpu") == 1


def test_engine_size_rows_have_their_own_bars():
    """float32 inputs keep the 1e-4 bar at engine sizes; bf16 inputs are held to bf16's level."""
    for op in ("chunk_prefill", "recurrent_forward"):
        assert check.CHECKS[f"{op} 2k H32 float32"].tolerance == 1e-4
        assert check.CHECKS[f"{op} 2k H32 bf16"].tolerance == 2e-2
