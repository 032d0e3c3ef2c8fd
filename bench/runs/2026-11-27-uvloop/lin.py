"""scratch: the bf16 kernel's products at rows, lower quartile of interleaved calls, µs"""
import sys, time, torch
from workers.engine.bf16_linear import bf16_kernel
from workers.engine.loader import default_cache_dir

ROWS = [int(r) for r in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1,4,6,7,8,9,10,11,12,13,16,17,18,24]
kernel = bf16_kernel(torch.bfloat16, torch.device("cpu"), default_cache_dir(), 2, True)
torch.set_num_threads(1)
shapes = {"gate_up": (576, 3072), "down": (1536, 576), "qkv": (576, 960), "o": (576, 576), "lm_head": (576, 49152)}
packed = {name: (kernel.pack(torch.randn(n, k).to(torch.bfloat16)), k, n) for name, (k, n) in shapes.items()}
xs = {(name, r): torch.randn(r, k).to(torch.bfloat16) for name, (_, k, _) in packed.items() for r in ROWS}
times = {key: [] for key in xs}
for rep in range(40):
    for (name, r), x in xs.items():
        p, k, n = packed[name]
        s = time.perf_counter(); kernel.linear(x, p, None, n); times[(name, r)].append(time.perf_counter() - s)
for name in shapes:
    print(name, " ".join(f"{r}:{1e6*sorted(times[(name, r)])[10]:.0f}" for r in ROWS))
