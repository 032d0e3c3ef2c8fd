"""Per-request speculation control: the `speculation` extra-body field against the server's.

A request may turn speculation off, name the drafter it expects, shrink the
tree and opt into a lossy acceptance rule. `control` checks that against
what the deployment has and allows and gives the one `Control` the loop runs
with; every refusal is a 400 naming `speculation.<field>`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from gateway.errors import APIError
from gateway.schemas import SpeculationRequest
from workers.protocol import TreeSpec
from workers.speculation.acceptance import EXACT, AcceptanceRule

Method = Literal["off", "ngram", "draft"]
OFF = TreeSpec(depth=0, budget=0)  # no tree: the draft is never asked


@dataclass(frozen=True)
class Control:
    """How one request speculates."""

    method: Method  # what drafts its trees: nothing, the n-gram drafter or a draft model
    spec: TreeSpec  # the largest tree per round: the server's, capped by the request
    acceptance: AcceptanceRule = EXACT  # exact unless the request opted in and the server allows

    def stats(self) -> dict:
        """What `speculation_stats` reports of it."""
        return {
            "method": self.method,
            "max_depth": self.spec.depth,
            "max_nodes": self.spec.budget,
            "acceptance": self.acceptance.kind,
            "lossless": self.acceptance.lossless,
        }


def control(
    request: SpeculationRequest | None,
    server: TreeSpec,
    available: Method,
    allow_lossy: bool,
) -> Control:
    """The request's speculation within the server's tree `server`, the deployment's drafter
    `available` ("off" when it has none) and whether lossy rules are allowed."""
    request = request or SpeculationRequest()
    method = available if request.method == "auto" else request.method
    if method not in ("off", available):
        has = "no draft" if available == "off" else f'the "{available}" draft only'
        raise APIError(
            400,
            f'`speculation.method` "{method}" is not available: this server has {has}',
            "speculation.method",
            "speculation_method_unavailable",
        )
    spec = OFF if method == "off" else server
    depth = spec.depth if request.max_depth is None else min(spec.depth, request.max_depth)
    budget = spec.budget if request.max_nodes is None else min(spec.budget, request.max_nodes)
    if depth == 0 or budget == 0:
        method, depth, budget = "off", 0, 0
    rule = acceptance(request, allow_lossy)
    return Control(method, replace(spec, depth=depth, budget=budget), rule)


def acceptance(request: SpeculationRequest, allow_lossy: bool) -> AcceptanceRule:
    if request.acceptance == "exact":
        return EXACT
    if not allow_lossy:
        raise APIError(
            400,
            f'`speculation.acceptance` "{request.acceptance}" is lossy (the text may differ from '
            "the target's own) and this server does not allow lossy acceptance (--allow-lossy); "
            'use "exact"',
            "speculation.acceptance",
            "lossy_acceptance_forbidden",
        )
    given = {
        name: value
        for name in ("threshold", "epsilon", "delta")
        if (value := getattr(request, name)) is not None
    }
    return AcceptanceRule(request.acceptance, **given)
