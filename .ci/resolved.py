"""Reads a `pip install --dry-run --report` file: kdakit resolved beside the given torch,
and Triton is the one that torch asks for (nothing of the engine's pins changed)."""
import json
import re
import sys

report, torch_version = sys.argv[1], sys.argv[2]
installs = json.load(open(report))["install"]
chosen = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in installs}
assert chosen.get("torch") == torch_version, f"torch resolved to {chosen.get('torch')}, not {torch_version}"
assert "kdakit" in chosen, sorted(chosen)
torch_requires = next(item["metadata"].get("requires_dist", []) for item in installs
                      if item["metadata"]["name"].lower() == "torch")
triton = chosen.get("triton")
for requirement in torch_requires:
    pin = re.match(r"triton\s*(~=|==)\s*([0-9.]+)", requirement)
    if pin:
        op, version = pin.groups()
        wanted = version.rsplit(".", 1)[0] + "." if op == "~=" else version
        assert triton is not None and (triton.startswith(wanted) if op == "~=" else triton == version), \
            f"torch {torch_version} asks {requirement!r}; resolved triton {triton}"
print(f"torch {torch_version} + kdakit {chosen['kdakit']}: triton {triton} (torch asks "
      f"{[r for r in torch_requires if r.lower().startswith('triton')]})")
