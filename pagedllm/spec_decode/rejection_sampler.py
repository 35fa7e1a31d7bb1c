"""Which drafts a step accepts: the rejection sampler for point-mass drafts.

Speculative sampling (Leviathan et al., Chen et al.) accepts draft ``d`` at a position where the
target distribution is ``p`` and the draft's is ``q`` with probability ``min(1, p(d) / q(d))``,
and on rejection draws the position's token from the normalised residual ``max(0, p - q)``; the
output is then distributed exactly as ``p``. Every proposer here drafts deterministically (n-gram
lookup, the draft model's argmax: vLLM V1 does the same), so ``q`` is a point mass on ``d``:
acceptance has probability ``p(d)`` and the residual is ``p`` without ``d``, renormalised.

The runner realises that with one draw per position: it samples ``x ~ p`` at every verified
position with the request's full sampling parameters (temperature, top-k/top-p/min-p,
penalties over the history up to that position, logit bias, the grammar bitmask, the seed of that
output position), and accepts the draft iff ``x == d``. ``P(x == d) = p(d)``, and given ``x != d``,
``x`` is distributed as the residual: the same law, with no extra kernel. Greedy requests sample the
argmax, so this is "accept while equal". A seeded request draws the same noise at an output
position with or without speculation, so it produces the same text either way.
"""

from __future__ import annotations


def accept_drafts(target_token_ids: list[int], draft_token_ids: list[int]) -> list[int]:
    """The tokens a request gets from a step that verified ``draft_token_ids``:
    ``target_token_ids[j]`` is the target's draw at the position after the request's known tokens
    plus its first j drafts (``len(draft_token_ids) + 1`` of them). Drafts are accepted while each
    equals the draw at its position; the draw at the first rejection (or after the last draft,
    the bonus token) ends the list. Cost: O(accepted)."""
    num_accepted = 0
    for draft, drawn in zip(draft_token_ids, target_token_ids):
        if draft != drawn:
            break
        num_accepted += 1
    return target_token_ids[: num_accepted + 1]
