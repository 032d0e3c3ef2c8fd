"""Where each streamed token came from: the stream's opt-in `specsplit` extension.

A streaming request with `"stream_options": {"include_provenance": true}` gets,
beside `choices` on each chunk that carries a choice's text, an object

    "specsplit": {
      "tokens": [{"i": 7, "text": " the", "round": 3, "source": "draft",
                  "kind": "accepted", "drafter": "ngram"}, ...],
      "rounds": [{"round": 3, "tree_nodes": 12, "accepted": 4, "lookup_nodes": 0,
                  "lookup_accepted": 0, "tokens": 5, "forwards": 1,
                  "drafter": "ngram", "degraded": false, "draft_ms": 0.4,
                  "verify_ms": 41.2}]
    }

- `tokens`: the generated tokens whose text the chunk carries, in order; their
  `text`s join to exactly the chunk's text. `i` counts the choice's generated
  tokens from 0. `source` "draft": a draft token the target accepted (`kind`
  "accepted", `drafter` "ngram" (prompt lookup: the gateway's, or the target
  worker's own during decode steps), "model" (a draft model), "feature" (an
  EAGLE-style head) or "hybrid" (either's tree merged with the gateway's prompt
  lookup)); "target": the token the target adds after the accepted path, a
  "correction" where it replaced a draft guess the target rejected, a "bonus"
  where the draft had proposed nothing further.
  A character that several tokens make (the bytes of one UTF-8 character) is
  the text of the first of them, and the others have "" (they still come, with
  their own round and source). A token whose text a possible stop string holds
  back in part comes in two chunks, with the same `i`.
- `rounds`: the rounds verified since the choice's previous chunk (a round
  whose text is all held back is reported with the next one): its tree's
  nodes and the draft tokens accepted of them, the tokens the target's own
  lookup drafted during its steps (`--decode-lookup`) and those accepted, the
  tokens it committed, the target forwards that made them (more than one
  where a round without a draft had the target decode several tokens in a
  row: `--decode-steps`) and the time of its propose and verify calls.

Clients that do not ask see no change, and the text is the same either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.text import Piece
from workers.loop import Round


@dataclass(frozen=True)
class Origin:
    """Where one generated token came from."""

    round: int  # the choice's round that committed it, from 1
    source: str  # "draft" (accepted from the draft's tree) or "target"
    kind: str  # "accepted" (draft), "bonus" or "correction" (target)
    drafter: str | None = None  # for draft tokens: "ngram", "model", "feature" or "hybrid"

    def as_dict(self) -> dict:
        out = {"round": self.round, "source": self.source, "kind": self.kind}
        return {**out, "drafter": self.drafter} if self.drafter else out


@dataclass
class Provenance:
    """One choice's token origins, and its rounds not yet reported."""

    origins: list[Origin] = field(default_factory=list)  # one per generated token
    pending: list[dict] = field(default_factory=list)  # rounds since the last chunk
    count: int = 0  # rounds so far

    def add(self, round_: Round, drafter: str | None) -> None:
        """A committed round: its tokens' origins (accepted draft tokens, then the target's)."""
        self.count += 1
        target = "correction" if round_.corrected else "bonus"
        looked_up = set(round_.looked_up)
        for k in range(len(round_.tokens)):
            if k in looked_up:
                self.origins.append(Origin(self.count, "draft", "accepted", "ngram"))
            elif k < round_.tree_accepted:
                self.origins.append(Origin(self.count, "draft", "accepted", drafter))
            else:
                self.origins.append(Origin(self.count, "target", target))
        draft_s, verify_s = round_.seconds
        self.pending.append(
            {
                "round": self.count,
                "tree_nodes": round_.tree_nodes,
                "accepted": round_.tree_accepted,
                "lookup_nodes": round_.lookup_nodes,
                "lookup_accepted": len(round_.looked_up),
                "tokens": len(round_.tokens),
                "forwards": round_.steps,
                "drafter": drafter if round_.tree_nodes else None,
                "degraded": round_.degraded,
                "draft_ms": round(draft_s * 1000, 2),
                "verify_ms": round(verify_s * 1000, 2),
            }
        )

    def take(self, piece: Piece) -> dict:
        """The extension for the chunk carrying `piece`; the pending rounds go with it."""
        tokens = [{"i": i, "text": text, **self.origins[i].as_dict()} for i, text in piece.spans]
        rounds, self.pending = self.pending, []
        return {"tokens": tokens, "rounds": rounds}
