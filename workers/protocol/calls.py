"""The calls a session makes of its workers and what they answer.

Each call names the session, the history length the caller believes the
worker holds (`base_len`, 0 = start over from the full history) and the
tokens committed since. The gateway owns the truth; a worker only caches it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.protocol.errors import IncompatibleWorkers
from workers.speculation.acceptance import EXACT, AcceptanceRule
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree


@dataclass(frozen=True)
class TreeSpec:
    """How big a tree to propose."""

    depth: int = 6  # most levels below the root
    branching: int = 2  # children per expanded node; 1 = a chain
    budget: int = 16  # most nodes in the tree
    temperature: float = 0.0  # 0: deterministic top-k children; > 0: sampled children
    seed: int | None = None  # makes sampled trees reproducible

    def __post_init__(self):
        if self.depth < 0 or self.branching < 1 or self.budget < 0:
            raise ValueError(
                f"tree depth {self.depth}, branching {self.branching} and budget "
                f"{self.budget} must be >= 0, >= 1 and >= 0"
            )

    @property
    def params(self) -> SamplingParams:
        """How the draft draws children (validates the temperature)."""
        return SamplingParams(temperature=self.temperature, seed=self.seed)


FEATURE_DTYPE = torch.bfloat16  # hidden states on the wire: fp32's range in half its bytes


@dataclass(frozen=True)
class Features:
    """The target's final hidden states (before the final norm) at consecutive history
    positions: what a feature (EAGLE-style) draft feeds on.

    Row i is the state after token `start + i`, the one the target's next-token
    distribution at position `start + i + 1` came from. bfloat16, not float16: a
    residual stream has outliers far past float16's 65,504, and bfloat16 keeps
    float32's exponent; the few mantissa bits it drops cost a draft nothing.
    """

    start: int  # history position of the first row
    states: torch.Tensor  # (R, E) FEATURE_DTYPE

    def __post_init__(self):
        if self.states.dim() != 2 or self.states.dtype != FEATURE_DTYPE or self.start < 0:
            raise ValueError(
                f"features must be (R, E) {FEATURE_DTYPE} from a position >= 0, got "
                f"{tuple(self.states.shape)} {self.states.dtype} from {self.start}"
            )

    @property
    def end(self) -> int:
        """One past the last position covered."""
        return self.start + self.states.shape[0]

    def at(self, positions: range, width: int) -> torch.Tensor:
        """(len(positions), width) float32: the rows of `positions`, zeros where not covered."""
        if self.states.shape[1] != width:
            raise ValueError(f"hidden states of width {self.states.shape[1]}, expected {width}")
        out = torch.zeros(len(positions), width)  # (P, E)
        lo, hi = max(positions.start, self.start), min(positions.stop, self.end)
        if lo < hi:
            first = lo - positions.start
            out[first : first + hi - lo] = self.states[lo - self.start : hi - self.start].float()
        return out


@dataclass(frozen=True)
class ProposeCall:
    session_id: str
    base_len: int  # history length the caller believes the worker holds (0 = start over)
    tokens: list[int]  # committed since then, or the full history when base_len == 0
    spec: TreeSpec
    # whose request (a hash of its API key; '' = no key): the in-gateway n-gram drafter
    # also drafts from this tenant's earlier outputs (None: not at all, a seeded sample).
    # Not sent over gRPC.
    tenant: str | None = ""
    features: Features | None = None  # a feature draft's input: the latest verify's states
    cache_salt: str = ""  # its KV prefixes are shared only with calls of the same salt


@dataclass(frozen=True)
class VerifyCall:
    session_id: str
    base_len: int  # history length the caller believes the worker holds (0 = start over)
    tokens: list[int]  # committed since then, or the full history when base_len == 0
    tree: TokenTree  # the draft's proposal after those tokens (may be empty)
    params: SamplingParams
    num_logprobs: int = -1  # -1: no logprobs; n >= 0: logprob of each emitted token + top n
    acceptance: AcceptanceRule = EXACT  # how draft tokens are accepted; only exact is lossless
    return_hidden: bool = False  # return the committed positions' hidden states (feature drafts)
    cache_salt: str = ""  # its KV prefixes are shared only with calls of the same salt
    # with an empty tree: decode up to this many tokens on the worker, one forward each,
    # before answering (workers/target/runner.py, "Decode steps"); fewer after a `stop_ids`
    # token. A tree, or return_hidden, answers after one forward whatever this says
    steps: int = 1
    stop_ids: tuple[int, ...] = ()  # tokens that end a generation: no step follows them
    # with steps > 1, an exact call, greedy or sampled without a seed: each step also
    # verifies up to this many tokens the worker drafts by prompt lookup over the session's
    # history (runner.py, "Lookup during decode steps"), and the call emits up to `most`
    # tokens (0: steps)
    lookup: int = 0
    most: int = 0

    def __post_init__(self):
        if self.steps < 1 or self.lookup < 0 or self.most < 0:
            raise ValueError(
                f"need steps >= 1, lookup >= 0, most >= 0; got {self.steps}, {self.lookup}, "
                f"{self.most}"
            )

    @property
    def most_emitted(self) -> int:
        """The most tokens the call emits."""
        return self.most or self.steps


class Unfinished:
    """A runner's answer to a call that needs another step: a long prompt is prefilled in
    chunks, one per step, between the other sessions' rounds. The caller runs the same
    call object again (the batcher re-queues it)."""


UNFINISHED = Unfinished()


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the n most likely tokens at that position


@dataclass(frozen=True)
class Timings:
    """Where one call's time went on the worker."""

    # arrival -> start of its batch (of its last one, for a call answered after several
    # steps: a prefill's chunks, decode steps), so that the call's time less this is one
    # step's
    queue_ns: int = 0
    forward_ns: int = 0  # the batch's model work, shared by its calls
    batch_size: int = 0  # calls in that batch
    # tokens its forward fed, cached prompt blocks not, in tokens fed for their logits: a
    # prompt token fed for its keys and values alone counts the share of the work it needs
    # (NativeLlama.prompt_token_share); 0 = not reported
    batch_tokens: int = 0


@dataclass(frozen=True)
class VerifyOutcome:
    accepted: list[int]  # accepted node indices, root to deepest
    emitted: list[int]  # the accepted nodes' tokens, then the bonus token
    logprobs: list[TokenLogprob] | None  # one per emitted token, when asked
    prefix_hit: int  # cached tokens reused when the session (re)started
    timings: Timings = field(default_factory=Timings)  # filled in by a served worker
    hidden: Features | None = None  # when asked: the states after each token fed and committed
    dropped: int = 0  # nodes at the tree's end the target left out (workers/target/runner.py)
    steps: int = 1  # forwards that made `emitted` (VerifyCall.steps; 1 with a tree)
    lookup_nodes: int = 0  # tokens the worker's own lookup drafted in those steps
    lookup_accepted: tuple[int, ...] = ()  # of `emitted`, the indices of those accepted


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker says about itself (the Info call)."""

    role: str  # "draft" or "target"
    model_id: str  # alias, directory or HF id; "ngram" for the model-free drafter
    tokenizer_fingerprint: str  # pairs draft and target; "" = model-free drafter, pairs with any
    vocab_size: int  # token ids are in [0, vocab_size); 0 = unknown (model-free)
    context_length: int  # most tokens per session; 0 = unlimited
    max_sessions: int  # sessions held at once; 0 = unlimited
    live_sessions: int = 0  # sessions held now
    eos_token_ids: tuple[int, ...] = ()  # tokens that end a generation
    max_tree_nodes: int = 0  # most draft nodes per tree; 0 = no limit stated
    kv_tokens: int = 0  # KV cache positions shared by all sessions (paged); 0 = no cache
    kv_tokens_used: int = 0  # of those, positions held by sessions now
    # a target: the width of the hidden states it returns; a draft: the width of the target
    # states it feeds on (a feature draft), 0 = none
    feature_size: int = 0
    # a target: the tokens a forward may feed and still carry decode steps' own lookups at
    # next to no cost (TargetRunner.lookup_rows); None = not stated (an older worker)
    lookup_rows: int | None = None

    def pairs_with(self, fingerprint: str) -> bool:
        """Whether this worker's token ids mean the same as a tokenizer's with `fingerprint`."""
        mine = self.tokenizer_fingerprint
        return not mine or not fingerprint or mine == fingerprint


def check_pair(draft: WorkerInfo, target: WorkerInfo) -> None:
    """Raises IncompatibleWorkers unless the draft's token ids mean the same to the target."""
    if draft.role != "draft" or target.role != "target":
        raise IncompatibleWorkers(
            f"expected a draft and a target worker, got {draft.role!r} and {target.role!r}"
        )
    if not draft.pairs_with(target.tokenizer_fingerprint):
        raise IncompatibleWorkers(
            f"draft {draft.model_id!r} and target {target.model_id!r} use different tokenizers "
            f"(fingerprints {draft.tokenizer_fingerprint} and {target.tokenizer_fingerprint}): "
            "draft token ids would mean other text to the target"
        )
    if draft.feature_size and draft.feature_size != target.feature_size:
        raise IncompatibleWorkers(
            f"feature draft {draft.model_id!r} feeds on hidden states of width "
            f"{draft.feature_size}, target {target.model_id!r} has {target.feature_size}"
        )
