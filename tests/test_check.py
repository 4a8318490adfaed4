"""`kdakit check` (the CLI's table of every backend against the float64 reference)."""
from kdakit import check


def test_every_op_and_backend_agree_with_the_reference_on_cpu():
    rows = check.run("cpu")
    assert {r["backend"] for r in rows} == {"reference", "triton"}  # conftest turns the interpreter on
    assert {r["op"] for r in rows} == set(check.CHECKS)
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
