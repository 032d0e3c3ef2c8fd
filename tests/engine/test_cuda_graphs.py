"""CUDA graphs (workers/engine/cuda_graphs.py) change no bit of a forward.

Graphs replay one captured forward per batch layout, with key widths padded to powers
of two blocks; the padding is checked here on $SPECSPLIT_TEST_DEVICE (tests/engine/tiny.py:
the CPU unless set), the replays on a CUDA GPU where there is one (bench/GPU.md).
"""

import pytest
import torch

from tests.engine.tiny import engine_device, tiny_hf_model
from workers.engine.batch import SlotInput, build_batch
from workers.engine.cuda_graphs import CudaGraphs, widen
from workers.engine.engine import Engine, EngineConfig

DTYPES = [torch.float32, torch.bfloat16]
SEQ = torch.randint(0, 96, (90,), generator=torch.Generator().manual_seed(21)).tolist()
OTHER = torch.randint(0, 96, (23,), generator=torch.Generator().manual_seed(22)).tolist()
TREE = [-1, 0, 0, 1, 2]  # (5,): a root, two children, a grandchild under each
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def chain(n: int) -> list[int]:
    return [i - 1 for i in range(n)]


def engine(dtype: torch.dtype, device: str, graphs: bool = True) -> Engine:
    hf = tiny_hf_model("llama", seed=9).to(dtype).to(device)
    config = EngineConfig(
        device=device, max_sessions=2, max_seq_len=256, attention="chunked", cuda_graphs=graphs
    )
    return Engine.from_hf(hf, None, config, "t")


def steps() -> list[list[SlotInput]]:
    """Prefills of two lengths, decode rows, a tree beside a decode row: each forward's
    rows, the cache growing across block boundaries (chains need no commit)."""
    out = [[SlotInput(0, 0, chain(37), SEQ[:37], 37), SlotInput(1, 0, chain(23), OTHER, 23)]]
    for i in range(37, 60):
        out.append([SlotInput(0, i, [-1], [SEQ[i]]), SlotInput(1, i - 14, [-1], [SEQ[i]])])
    out.append([SlotInput(0, 60, TREE, SEQ[60:65], 5), SlotInput(1, 46, [-1], [SEQ[60]])])
    return out


def test_widen_pads_to_powers_of_two_blocks():
    widths = [16, 32, 48, 64, 80, 256, 272]
    assert [widen(w, 16, 272) for w in widths] == [16, 32, 64, 64, 128, 256, 272]
    assert [widen(w, 16, 100_000) for w in (272, 1040)] == [512, 2048]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_widened_key_rows_give_the_same_bits(dtype):
    eng = engine(dtype, engine_device(), graphs=False)
    block, most = eng.cache.block_size, eng.cache.max_blocks * eng.cache.block_size
    wider = 0
    for rows in steps():
        for r in rows:
            eng.cache.reserve(r.slot, r.prefix_len + len(r.parents))
        exact = build_batch(rows, eng.cache, eng.device)
        wide = build_batch(rows, eng.cache, eng.device, widen=lambda w: widen(w, block, most))
        keys = [(g.shared, g.tail) for g in wide.groups]
        before = [(g.shared, g.tail) for g in exact.groups]
        for (ws, wt), (es, et) in zip(keys, before, strict=True):
            wider += ws.width > es.width or (wt is not None and wt.width > et.width)
        with torch.inference_mode():
            assert torch.equal(
                eng.model.hidden(eng.cache, wide), eng.model.hidden(eng.cache, exact)
            )
    assert wider > 10  # most steps padded something


def test_no_graphs_off_a_gpu():
    assert engine(torch.float32, "cpu").graphs is None


class Rerun:
    """Records a forward by keeping it: a replay runs it again over the recorded inputs,
    as a CUDA graph replays its kernels over them (the graphs' bookkeeping, on a CPU)."""

    def record(self, run):
        output = run()
        return output.clone(), output, lambda: output.copy_(run())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_replays_over_the_copied_inputs_give_the_eager_bits(dtype):
    """Each layout recorded once, later forwards replayed over their own tensors copied
    into the recorded ones: a tensor copied into the wrong place, or left out, would
    replay another step's tokens or keys."""
    replayed, eager = engine(dtype, "cpu", graphs=False), engine(dtype, "cpu", graphs=False)
    cache = replayed.cache
    widest = cache.max_blocks * cache.block_size
    replayed.graphs = CudaGraphs(cache.block_size, widest, recorder=Rerun())
    for rows in steps():
        for got, want in zip(replayed.forward(rows), eager.forward(rows), strict=True):
            assert torch.equal(got, want)
    assert len(replayed.graphs.graphs) == 3 and replayed.graphs.replays == 22


@CUDA
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_graph_replays_give_the_eager_bits(dtype):
    graphed, eager = engine(dtype, "cuda"), engine(dtype, "cuda", graphs=False)
    assert graphed.graphs is not None and eager.graphs is None
    for rows in steps():
        got, want = graphed.forward(rows), eager.forward(rows)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
    assert graphed.graphs.replays > 15  # the decode steps after each layout's capture
    assert len(graphed.graphs.graphs) == 3  # the prefills, the decode steps (64 keys), the tree


@CUDA
def test_graph_replays_through_greedy_decoding_equal_transformers():
    """fp32 on the GPU: the loop over a graphed engine gives transformers' greedy tokens."""
    from workers.engine.sessions import SessionTable
    from workers.loop.inprocess import LocalDecoder
    from workers.speculation.sampling import SamplingParams
    from workers.target.runner import TargetRunner

    eng = engine(torch.float32, "cuda")
    hf = tiny_hf_model("llama", seed=9)
    decoder = LocalDecoder(TargetRunner(eng, SessionTable(2)))
    prompt = SEQ[:20]
    got = decoder.generate(prompt, 60, SamplingParams()).token_ids
    with torch.no_grad():
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=60, min_new_tokens=60)
    assert got == ids[0, len(prompt) :].tolist()
    assert eng.graphs.replays > 50


@CUDA
def test_a_capture_lets_other_threads_use_the_gpu():
    """A worker captures on its engine thread while another thread of the process loads
    weights onto the GPU (a second engine, a server restarting): neither fails."""
    import threading

    from workers.engine.cuda_graphs import CudaRecorder

    x = torch.arange(8.0, device="cuda")
    loaded = []

    def run() -> torch.Tensor:
        other = threading.Thread(target=lambda: loaded.append(torch.ones(64).to("cuda")))
        other.start()
        other.join()
        return x * 2 + 1

    now, output, replay = CudaRecorder().record(run)
    x.copy_(torch.arange(8.0, 16.0, device="cuda"))
    replay()
    assert torch.equal(now, torch.arange(8.0, device="cuda") * 2 + 1)
    assert torch.equal(output, torch.arange(8.0, 16.0, device="cuda") * 2 + 1)
    assert len(loaded) == 2 and all(t.sum().item() == 64 for t in loaded)
