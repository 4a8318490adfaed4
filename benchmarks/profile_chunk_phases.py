"""Scratch: GPU time of the chunk prefill's prep kernel with phases cut out, and state-kernel configs."""
import importlib.util, os, sys
from dataclasses import replace
import torch
sys.path.insert(0, os.path.dirname(__file__))
from profile_chunk_prefill import kernel_times, CASES  # noqa
from bench_chunk_prefill import make_layer  # noqa
import kdakit.ops.chunk_prefill as real

src = open(real.__file__).read()
src = src.replace("from .. import", "from kdakit import").replace("from ..backends", "from kdakit.backends").replace(
    "from .launch", "from kdakit.ops.launch").replace("from .triton_math", "from kdakit.ops.triton_math")
src = src.replace('@register("chunk_prefill", "triton")', '').replace('@register("chunk_prefill", "reference")', '')
a = src.index('    # ---- A (β-scaled'); b = src.index('    # ---- T = (I + A)^-1'); c = src.index('    # ---- w = T diag')
e = src.index('@triton.jit\ndef _invert_unit_lower')
cuts = {"full": src, "p1": src[:a] + "\n\n" + src[e:], "p12": src[:b] + "\n\n" + src[e:],
        "p123": src[:c] + "\n\n" + src[e:], "p1_5": src[:a] + src[c:]}
mods = {}
for name, text in cuts.items():
    path = f"/tmp/cp_{name}.py"
    open(path, "w").write(text)
    spec = importlib.util.spec_from_file_location(f"cp_{name}", path)
    m = importlib.util.module_from_spec(spec); sys.modules[spec.name] = m; spec.loader.exec_module(m)
    mods[name] = m

for case in sys.argv[1].split(","):
    L = make_layer(CASES[case], 32, 32, 128, 128)
    N = len(CASES[case])
    base = real.chunk_config(N, 32, 128, 128)
    print(case, base, flush=True)

    def call(m, cfg, lb=None):
        return lambda: m.chunk_prefill_triton(L["q"], L["k"], L["v"], L["g"], L["beta"], L["state"], L["idx"], L["out"],
                                              cu_seqlens=L["cu"], scale=128 ** -0.5, use_qk_l2norm=True, A_log=L["A_log"],
                                              dt_bias=L["dt_bias"], lower_bound=lb, beta_mode=1, has_initial_state=None,
                                              chunk_states=None, chunk_state_indices=None, config=cfg)
    rows = []
    for name, m in mods.items():
        for sk, pw in ((8, 4), (8, 8)):
            if name != "full" and (sk, pw) != (8, 4):
                continue
            cfg = replace(base, prep_warps=pw)
            try:
                t = kernel_times(call(m, cfg))
                rows.append((f"prep {name} sub_k={sk} warps={pw}", t.get("_chunk_prep_kernel", 0), t.get("_chunk_state_kernel", 0)))
            except Exception as exc:
                rows.append((f"prep {name} sub_k={sk} warps={pw} FAILED {type(exc).__name__}", 0, 0))
            print(rows[-1], flush=True)
    t = kernel_times(call(real, base, -5.0))
    rows.append(("full safe gate", t.get("_chunk_prep_kernel", 0), t.get("_chunk_state_kernel", 0)))
    print(rows[-1], flush=True)
    for bv in (16, 32, 64):
        for sw in (4, 8):
            for st in (1, 2):
                cfg = replace(base, block_v=bv, state_warps=sw, pipeline_stages=st)
                try:
                    t = kernel_times(call(real, cfg))
                    rows.append((f"state bv={bv} warps={sw} stages={st}", t.get("_chunk_prep_kernel", 0), t.get("_chunk_state_kernel", 0)))
                except Exception as exc:
                    rows.append((f"state bv={bv} warps={sw} stages={st} FAILED {type(exc).__name__}", 0, 0))
                print(rows[-1], flush=True)
    print(f"== {case}")
    for r in rows:
        print(f"{r[0]:45s} prep {r[1]:9.1f} us  state {r[2]:9.1f} us")
