import time, torch, sys, dataclasses
from workers.draft.features import model_drafter
from workers.engine.engine import Engine, EngineConfig
from workers.engine.sessions import SessionTable
from workers.engine.text import encode_chat, stop_token_ids
from workers.loop.inprocess import LocalDecoder
from workers.protocol import TreeSpec
from workers.speculation.sampling import SamplingParams
from workers.target.runner import TargetRunner
from workers.tools.distill import prompts
torch.set_num_threads(1)
cfg = EngineConfig(model="smollm2-135m-instruct", max_sessions=2, max_seq_len=1024, dtype="bfloat16", kernel_threads=2)
target = Engine.load(cfg)
draft = Engine.load(dataclasses.replace(cfg, model=sys.argv[1]))
stops = stop_token_ids(target.tokenizer)
chats = [encode_chat(target.tokenizer, [{"role": "user", "content": t}]) for t in prompts.take("unlike", 1, 4)]
drafter = model_drafter(draft, SessionTable(2))
spent = [0.0, 0]
orig = drafter.propose
def timed(calls):
    t = time.perf_counter(); r = orig(calls); spent[0] += time.perf_counter() - t; spent[1] += 1; return r
drafter.propose = timed
d = LocalDecoder(TargetRunner(target, SessionTable(2)), drafter, TreeSpec(depth=3, branching=2, budget=6), stops)
d.generate(chats[0][:24], 4, SamplingParams())
for rep in range(3):
    spent[:] = [0.0, 0]; t = time.perf_counter(); n = steps = 0
    for ids in chats:
        g = d.generate(ids, 64, SamplingParams()); n += len(g.token_ids); steps += g.stats.verify_steps
    el = time.perf_counter() - t
    print(f"{n/el:.1f} tok/s, round {el/steps*1e3:.1f} ms, propose {spent[0]/spent[1]*1e3:.2f} ms, {n/steps:.2f} tok/round", flush=True)
