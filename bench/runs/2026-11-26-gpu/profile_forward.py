import cProfile
import pstats

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from workers.engine.engine import Engine, EngineConfig
from workers.tools.bench.forward import shapes
from workers.tools.bench.gpu import llama_1b

torch.manual_seed(0)
with torch.device("cuda"):
    hf = AutoModelForCausalLM.from_config(llama_1b(16), dtype=torch.bfloat16).eval()
config = EngineConfig("x", device="cuda", max_sessions=8, max_seq_len=1024)
eng = Engine.from_hf(hf, None, config, "x")
for shape in ("1 token", "17-token tree"):
    rows = shapes(eng.vocab_size)[shape]
    for _ in range(5):
        eng.forward(rows)
    print("=====", shape)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            eng.forward(rows)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(50):
        eng.forward(rows)
    pr.disable()
    pstats.Stats(pr).sort_stats("cumtime").print_stats(35)
