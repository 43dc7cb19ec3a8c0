"""What the scheduler asks of speculative decoding's drafts (pure Python, no jax): `NgramProposer`'s
lookups, `SuffixProposer`'s suffix matches, or `DraftModelProposer`'s smaller model."""

from typing import Protocol

from jaxserve.engine.request import Request


class Proposer(Protocol):
    num_speculative_tokens: int  # drafts a request gets at most
    probes_cheaply: bool  # a proposal costs little: the scheduler may ask one only to learn whether drafts come
    # The last `propose_batch` cost what a round costs while drafts run every step (a draft model's round that
    # also caught up on a prompt, or on the tokens of a pause, did not): the draft policy times only those.
    last_round_steady: bool

    def propose_batch(self, requests: list[Request], max_drafts: list[int]) -> list[list[int]]:
        """Up to min(num_speculative_tokens, max_drafts[i]) drafts to follow each running request's known
        tokens (`requests` are all the running ones, each with its last token to compute)."""
        ...

    def finish(self, request: Request) -> None:
        """A sequence left the scheduler (finished or aborted): drops what it keeps for it."""
        ...
