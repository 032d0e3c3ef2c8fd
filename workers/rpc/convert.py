"""Protobuf messages <-> the runners' dataclasses; shared by the servers and the clients.

Every `*_from_proto` function validates what the wire cannot (lengths that
must agree, parameter ranges, tree structure) and raises ValueError / TreeError,
which the workers answer with INVALID_ARGUMENT. Vocabulary and budget checks
need the worker's model and stay in the runners.
"""

from __future__ import annotations

import torch

from proto.specsplit.v1 import specsplit_pb2 as pb
from workers.protocol import (
    FEATURE_DTYPE,
    Features,
    ProposeCall,
    Timings,
    TokenLogprob,
    TreeSpec,
    VerifyCall,
    VerifyOutcome,
    WorkerInfo,
)
from workers.speculation.acceptance import EXACT, AcceptanceRule
from workers.speculation.sampling import SamplingParams
from workers.speculation.tree import TokenTree, TreeError

ROLES = {"draft": pb.ROLE_DRAFT, "target": pb.ROLE_TARGET}


# -- trees and parameters ------------------------------------------------------------------


def tree_to_proto(tree: TokenTree) -> pb.TokenTree:
    msg = pb.TokenTree(tokens=tree.tokens.tolist(), parents=tree.parents.tolist())
    if tree.q_tokens is not None and tree.q_probs is not None:
        msg.q_width = tree.q_tokens.shape[1]
        msg.q_tokens.extend(tree.q_tokens.reshape(-1).tolist())  # (N * K,) row-major
        msg.q_probs.extend(tree.q_probs.float().reshape(-1).tolist())  # (N * K,)
    return msg


def tree_from_proto(msg: pb.TokenTree) -> TokenTree:
    n, k = len(msg.tokens), msg.q_width
    if len(msg.parents) != n:
        raise TreeError(f"tree has {n} tokens but {len(msg.parents)} parents")
    tokens = torch.tensor(list(msg.tokens), dtype=torch.long)  # (N,)
    parents = torch.tensor(list(msg.parents), dtype=torch.long)  # (N,)
    if k == 0:
        if msg.q_tokens or msg.q_probs:
            raise TreeError("q_tokens / q_probs given without q_width")
        return TokenTree(tokens, parents)
    if len(msg.q_tokens) != n * k or len(msg.q_probs) != n * k:
        raise TreeError(
            f"q_tokens ({len(msg.q_tokens)}) and q_probs ({len(msg.q_probs)}) must both hold "
            f"N * K = {n} * {k} entries"
        )
    q_tokens = torch.tensor(list(msg.q_tokens), dtype=torch.long).view(n, k)  # (N, K)
    q_probs = torch.tensor(list(msg.q_probs), dtype=torch.float32).view(n, k)  # (N, K)
    return TokenTree(tokens, parents, q_tokens, q_probs)


def features_to_proto(features: Features) -> pb.HiddenStates:
    """The states as raw bfloat16 bytes: their bits, unchanged (no float conversion)."""
    rows, width = features.states.shape
    bits = features.states.contiguous().view(torch.int16)  # (R, E): the same 2 bytes each
    return pb.HiddenStates(
        start=features.start, rows=rows, width=width, data=bits.numpy().astype("<i2").tobytes()
    )


def features_from_proto(msg: pb.HiddenStates) -> Features:
    if len(msg.data) != 2 * msg.rows * msg.width:
        raise ValueError(
            f"hidden states of {msg.rows} x {msg.width} need {2 * msg.rows * msg.width} bytes, "
            f"got {len(msg.data)}"
        )
    if not msg.data:
        return Features(msg.start, torch.empty(msg.rows, msg.width, dtype=FEATURE_DTYPE))
    bits = torch.frombuffer(bytearray(msg.data), dtype=torch.int16)  # (R * E,) little-endian
    states = bits.view(FEATURE_DTYPE).view(msg.rows, msg.width)  # (R, E)
    return Features(msg.start, states)


def _features_field(name: str, features: Features | None) -> dict:
    return {} if features is None else {name: features_to_proto(features)}


def _features(msg, name: str) -> Features | None:
    return features_from_proto(getattr(msg, name)) if msg.HasField(name) else None


def params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(temperature=params.temperature, top_k=params.top_k)
    if params.top_p != 1.0:
        msg.top_p = params.top_p
    if params.seed is not None:
        msg.seed = params.seed
    if params.min_p:
        msg.min_p = params.min_p
    return msg


def params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        min_p=msg.min_p,
    )


def _acceptance_field(rule: AcceptanceRule) -> dict:
    if rule.lossless:
        return {}  # absent: exact
    return {
        "acceptance": pb.Acceptance(
            rule=rule.kind, threshold=rule.threshold, epsilon=rule.epsilon, delta=rule.delta
        )
    }


def _acceptance(msg: pb.VerifyRequest) -> AcceptanceRule:
    if not msg.HasField("acceptance") or msg.acceptance.rule in ("", "exact"):
        return EXACT
    a = msg.acceptance
    return AcceptanceRule(a.rule, a.threshold, a.epsilon, a.delta)


def spec_to_proto(spec: TreeSpec) -> pb.TreePolicy:
    msg = pb.TreePolicy(
        depth=spec.depth, branching=spec.branching, budget=spec.budget, temperature=spec.temperature
    )
    if spec.seed is not None:
        msg.seed = spec.seed
    return msg


def spec_from_proto(msg: pb.TreePolicy) -> TreeSpec:
    spec = TreeSpec(
        depth=msg.depth,
        branching=msg.branching,
        budget=msg.budget,
        temperature=msg.temperature,
        seed=msg.seed if msg.HasField("seed") else None,
    )
    spec.params  # noqa: B018 - validates the temperature now, not on the engine thread
    return spec


def timings_to_proto(t: Timings) -> pb.Timings:
    return pb.Timings(
        queue_ns=t.queue_ns,
        forward_ns=t.forward_ns,
        batch_size=t.batch_size,
        batch_tokens=t.batch_tokens,
    )


def timings_from_proto(msg: pb.Timings) -> Timings:
    return Timings(msg.queue_ns, msg.forward_ns, msg.batch_size, msg.batch_tokens)


def _session_id(msg) -> str:
    if not msg.session_id:
        raise ValueError("session_id is empty")
    return msg.session_id


def _logprobs_field(num_logprobs: int) -> dict:
    return {} if num_logprobs < 0 else {"num_logprobs": num_logprobs}


def _num_logprobs(msg) -> int:
    n = msg.num_logprobs if msg.HasField("num_logprobs") else -1
    if n < -1:
        raise ValueError(f"num_logprobs must be -1 (none) or >= 0, got {n}")
    return n


# -- draft ---------------------------------------------------------------------------------


def propose_request(call: ProposeCall) -> pb.ProposeRequest:
    return pb.ProposeRequest(
        session_id=call.session_id,
        base_len=call.base_len,
        tokens=call.tokens,
        policy=spec_to_proto(call.spec),
        **_features_field("hidden", call.features),
        cache_salt=call.cache_salt,
    )


def propose_call(msg: pb.ProposeRequest) -> ProposeCall:
    spec = spec_from_proto(msg.policy)
    features = _features(msg, "hidden")
    return ProposeCall(
        _session_id(msg), msg.base_len, list(msg.tokens), spec, "", features, msg.cache_salt
    )


def propose_response(tree: TokenTree, timings: Timings) -> pb.ProposeResponse:
    return pb.ProposeResponse(tree=tree_to_proto(tree), timings=timings_to_proto(timings))


# -- target --------------------------------------------------------------------------------


def verify_request(call: VerifyCall) -> pb.VerifyRequest:
    return pb.VerifyRequest(
        session_id=call.session_id,
        base_len=call.base_len,
        tokens=call.tokens,
        tree=tree_to_proto(call.tree),
        sampling=params_to_proto(call.params),
        **_logprobs_field(call.num_logprobs),
        **_acceptance_field(call.acceptance),
        return_hidden=call.return_hidden,
        cache_salt=call.cache_salt,
        steps=call.steps,
        stop_ids=call.stop_ids,
        lookup=call.lookup,
        most=call.most,
    )


def verify_call(msg: pb.VerifyRequest) -> VerifyCall:
    return VerifyCall(
        _session_id(msg),
        msg.base_len,
        list(msg.tokens),
        tree_from_proto(msg.tree),
        params_from_proto(msg.sampling),
        _num_logprobs(msg),
        _acceptance(msg),
        msg.return_hidden,
        msg.cache_salt,
        max(1, msg.steps),
        tuple(msg.stop_ids),
        msg.lookup,
        msg.most,
    )


def verify_response(outcome: VerifyOutcome) -> pb.VerifyResponse:
    msg = pb.VerifyResponse(
        accepted=outcome.accepted,
        emitted=outcome.emitted,
        bonus=outcome.emitted[-1],
        prefix_hit=outcome.prefix_hit,
        timings=timings_to_proto(outcome.timings),
        dropped=outcome.dropped,
        steps=outcome.steps,
        lookup_nodes=outcome.lookup_nodes,
        lookup_accepted=outcome.lookup_accepted,
        **_features_field("hidden", outcome.hidden),
    )
    for lp in outcome.logprobs or []:
        top = [pb.TopLogprob(token=t, logprob=v) for t, v in lp.top]
        msg.logprobs.append(pb.TokenLogprob(token=lp.token, logprob=lp.logprob, top=top))
    return msg


def verify_outcome(msg: pb.VerifyResponse) -> VerifyOutcome:
    logprobs = [
        TokenLogprob(lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top])
        for lp in msg.logprobs
    ]
    return VerifyOutcome(
        list(msg.accepted),
        list(msg.emitted),
        logprobs or None,
        msg.prefix_hit,
        timings_from_proto(msg.timings),
        _features(msg, "hidden"),
        msg.dropped,
        max(1, msg.steps),
        msg.lookup_nodes,
        tuple(msg.lookup_accepted),
    )


# -- info ----------------------------------------------------------------------------------


def info_to_proto(info: WorkerInfo) -> pb.InfoResponse:
    return pb.InfoResponse(
        role=ROLES[info.role],
        model_id=info.model_id,
        tokenizer_fingerprint=info.tokenizer_fingerprint,
        vocab_size=info.vocab_size,
        context_length=info.context_length,
        max_sessions=info.max_sessions,
        live_sessions=info.live_sessions,
        eos_token_ids=info.eos_token_ids,
        max_tree_nodes=info.max_tree_nodes,
        kv_tokens=info.kv_tokens,
        kv_tokens_used=info.kv_tokens_used,
        feature_size=info.feature_size,
        lookup_rows=info.lookup_rows,
    )


def info_from_proto(msg: pb.InfoResponse) -> WorkerInfo:
    role = next((name for name, value in ROLES.items() if value == msg.role), "unspecified")
    return WorkerInfo(
        role=role,
        model_id=msg.model_id,
        tokenizer_fingerprint=msg.tokenizer_fingerprint,
        vocab_size=msg.vocab_size,
        context_length=msg.context_length,
        max_sessions=msg.max_sessions,
        live_sessions=msg.live_sessions,
        eos_token_ids=tuple(msg.eos_token_ids),
        max_tree_nodes=msg.max_tree_nodes,
        kv_tokens=msg.kv_tokens,
        kv_tokens_used=msg.kv_tokens_used,
        feature_size=msg.feature_size,
        lookup_rows=msg.lookup_rows if msg.HasField("lookup_rows") else None,
    )
