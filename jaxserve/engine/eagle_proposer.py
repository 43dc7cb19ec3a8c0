"""Drafts from an EAGLE drafter (vLLM's "eagle" and "eagle3" methods; `models/eagle.py`, `models/eagle3.py`),
or from a model's own multi-token prediction layer, which drafts as one ("mtp"; `models/mtp.py`).

The drafter runs as a draft model does (`DraftModelProposer`: its own runner and KV cache, a catch-up then k - 1
decode steps a round), over the request shifted by one: its position j takes the token at j + 1 and the
target's final hidden state at j, so its last position is the one before the request's last token, and its
first draft follows that token. Two differences:
- Before each catch-up call, the target's states at the positions it computes are copied from the target's
  cache (`models/features.py`) into the drafter's, one small program per call (fused by EAGLE-3's `fc` on the
  way: `models/eagle3.py`). The target wrote them as it
  computed those tokens, in whatever step; they are read by the target's page tables, and prefix-cache hits
  and preemption need nothing more.
- The K/V its decode steps write for the drafts comes from its own outputs in place of the target's states,
  so it is not kept: a round computes the accepted drafts again from the target's states (as vLLM's EAGLE
  does), and positions before the round's start only are kept.
Its own cache keeps no prefix cache: a page of its positions depends on the token after the page. The
target's cache caches prefixes as ever.

Runs on the engine's thread, like the scheduler that calls it.
"""

from typing import Any

import jax
import numpy as np

from jaxserve.engine.draft_model_proposer import DraftModelProposer, _DraftState
from jaxserve.engine.kv_cache_manager import shared_window
from jaxserve.engine.request import Request
from jaxserve.ops.kv_write import padding_slot
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.step_fn import make_feature_copy_fn


def check_target_windows(target_cfg: Any) -> None:
    """Raises ValueError for a target whose every layer has a sliding window: it releases the pages that leave
    its windows (`KVCacheManager.release_outside_window`), and with them hidden states the drafter may not have
    caught up on yet (a long prompt's, a preempted request's). One full-attention layer keeps every page
    (GPT-OSS's alternate, Qwen2's `max_window_layers`). The drafter's own K/V is in its own cache."""
    if shared_window(getattr(target_cfg, "sliding_windows", ())) is not None:
        raise ValueError("an EAGLE drafter beside a target whose every layer has a sliding window is not served "
                         "yet: the target releases the pages, and with them the hidden states, that leave its "
                         "windows")


class _Shifted:
    """A request as the drafter reads it: its position j holds the request's token j + 1."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.request_id = request.request_id
        self.num_tokens = request.num_tokens - 1
        self.num_prompt_tokens = max(request.num_prompt_tokens - 1, 0)

    def token_ids(self, start: int, end: int) -> list[int]:
        return self.request.token_ids(start + 1, end + 1)


class EagleProposer(DraftModelProposer):
    """Proposes each running request's next k tokens, the EAGLE drafter's greedy continuation."""

    keeps_drafts = False
    lookahead = 1  # the last decode step writes its output as the next position's feature

    def __init__(self, runner: ModelRunner, target: ModelRunner, num_speculative_tokens: int,
                 vocab_size: int) -> None:
        """`runner`: the drafter's (its cache ending with its features' pages), its pages the target's size;
        `target`: the target's runner, whose cache ends with its final hidden states' pages."""
        if runner.features is None or target.features is None:
            raise ValueError("an EAGLE or MTP drafter reads the target's hidden states: both caches keep them")
        if runner.page_size != target.page_size:
            raise ValueError("the drafter's pages must be the target's size")
        super().__init__(runner, num_speculative_tokens, vocab_size, enable_prefix_caching=False)
        self.target = target
        self._copy = make_feature_copy_fn(runner.model.graphdef, jax.tree.structure(runner.model.state), runner.mesh)
        self._copies: dict[int, Any] = {}  # compiled by `warmup`, per token bucket
        self._padding = padding_slot(runner.num_pages, runner.page_size)

    def _view(self, request: Request) -> Any:
        return _Shifted(request)

    def _before_catch_up(self, rows: list[tuple[Any, _DraftState, int, int]]) -> None:
        """Copies the target's states at the rows' positions into the drafter's cache."""
        page_size = self.page_size
        sources, dests = [], []
        for view, state, start, end in rows:
            positions = np.arange(start, end)
            target_pages = np.asarray(view.request.page_ids, np.int64)
            own_pages = np.asarray(state.page_ids, np.int64)
            sources.append(target_pages[positions // page_size] * page_size + positions % page_size)
            dests.append(own_pages[positions // page_size] * page_size + positions % page_size)
        count = sum(len(source) for source in sources)
        size = next(size for size in self.runner.ladder.token_buckets if size >= count)  # one program a bucket
        source_slots = np.zeros(size, np.int32)
        dest_slots = np.full(size, self._padding, np.int32)
        source_slots[:count] = np.concatenate(sources)
        dest_slots[:count] = np.concatenate(dests)
        caches = self.runner.kv_caches
        copy = self._copies.get(size, self._copy)
        copied = copy(self.runner.wait_for_weights(), self.target.kv_caches[-1][0], caches[-1][0], source_slots,
                      dest_slots)
        self.runner.kv_caches = [*caches[:-1], (copied, None)]

    @property
    def page_size(self) -> int:
        return self.runner.page_size

    def warmup(self) -> None:
        """Compiles the copy for every token bucket of the drafter's ladder, so that none compiles in service."""
        weights = self.runner.wait_for_weights()
        target, own = self.target.kv_caches[-1][0], self.runner.kv_caches[-1][0]
        for size in self.runner.ladder.token_buckets:
            slots = np.zeros(size, np.int32)
            self._copies[size] = self._copy.lower(weights, target, own, slots, slots).compile()
