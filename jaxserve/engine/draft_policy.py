"""How many of the proposed drafts a speculative step verifies (pure Python, no jax).

A step's decode rows are padded to a request bucket, and what a bucket of R rows costs depends on the
hardware: on a GPU a decode step reads the weights once whatever R is (up to a few dozen rows), so rows
are nearly free; on a CPU the matmuls are compute-bound beyond a few rows, and the next bucket can cost
twice or four times the last. A draft is worth a row when it is likely to be accepted. So the policy picks,
among the buckets that hold the running requests, the one with the most expected tokens per second:

    rate(R) = (n + sum of the R - n best draft slots' acceptance probabilities) / (cost(R) + proposal + host)

where a request's draft at position p is accepted with probability a^p (each draft independently with
probability a, given the ones before it), slots are filled position by position across requests (every
request's first draft before any second one), and cost(R) is the measured step time of R rows.

- `a` is the maximum-likelihood rate of the recent verifications: accepted drafts over accepted drafts
  plus runs that ended in a rejection, both decaying so that the estimate follows the workload. A request
  whose drafts are not run still tells it something for free: its first draft against the token it then
  samples (`observe_first_draft`), so a workload that turns repetitive is noticed without any row spent.
- cost(R) is a moving average of the decode steps of R rows measured by the engine, its first
  measurement replaced by the second (a bucket's first run pays for what later runs find ready). A bucket
  not yet measured is assumed to cost what the largest measured bucket below it costs: optimistic, so it is
  tried when drafts would fill it, and measured then. Before the running requests' own bucket is measured,
  no draft is run (`choose` says so, and the scheduler plans a step that measures it).
- A time that is too high is never corrected by choosing on it: the bucket is not chosen again, so not
  measured again. Where one step was slow for a reason of its own (a compile or a burst of load beside it),
  drafting would stop for good. So a bucket is taken at the optimistic cost above, and tried again, while
  it has only its first measurement, and when its time has gone unmeasured for a number of choices that
  doubles with each such retry (16, 32, ... 1,024: a bucket that really costs too much wastes a step now and
  then, one that was unlucky comes back soon). A retry's measurement replaces the old time.
- `proposal` is a moving average of the time the proposer took to propose the drafts (n-gram lookups:
  next to nothing; a draft model: its calls), which a step without drafts does not pay; one per bucket of
  requests, as a round for 16 requests costs more than one for 1.
- `host` is the host's turn between steps (the step's outputs, their text, their streams), timed from a
  step's tokens read, where the step was read at once, to the next plan: a step with drafts is read at once and
  pays it,
  while plain steps overlap it with the device's next step under async scheduling, so a plain step then costs
  the longer of its step time and the host's turn (without async scheduling, the sum, as a drafting step).
- Without drafts the requests would run a plain step or, with multi-step decoding, k steps in one call;
  the rate drafts compete with is the better of the two, per step.
"""

import bisect

# Prior accepted drafts and rejections (a starts at 1/2), and the weight an observation keeps per newer one.
_PRIOR_ACCEPTED, _PRIOR_REJECTED, _DECAY = 1.0, 1.0, 0.98
_COST_WEIGHT = 0.2  # weight of the newest step in a bucket's moving average
# Choices after which a bucket's unmeasured time is tried again (module docstring), the first and the most
_FIRST_RETRY, _MAX_RETRY = 16, 1024


class DraftPolicy:
    def __init__(self, row_buckets: tuple[int, ...], max_rows: int, plain_overlaps: bool = True) -> None:
        """`row_buckets`: the runner's decode buckets (their rows), the last covering `max_rows`, the most rows
        a step may have. `plain_overlaps`: plain steps overlap the host's turn (async scheduling); else each
        pays it too."""
        self.row_buckets = tuple(row_buckets)
        self.max_rows = max_rows
        self.plain_overlaps = plain_overlaps
        self.costs: dict[int, float] = {}  # rows of a decode bucket -> seconds per step
        self.multi_step_costs: dict[int, float] = {}  # the same for multi-step decodes, per step
        self._num_measured: dict[tuple[bool, int], int] = {}
        self._num_choices = 0  # `choose` calls so far
        self._measured_at: dict[int, int] = {}  # rows of a decode bucket -> `_num_choices` at its last step
        self._retry_after: dict[int, int] = {}  # rows -> choices unmeasured after which it is tried again
        self._retrying: set[int] = set()  # buckets chosen at an assumed time: their next step replaces it
        self._accepted, self._rejected = _PRIOR_ACCEPTED, _PRIOR_REJECTED
        # Seconds a round of proposals takes, by the decode bucket that holds its requests (moving averages)
        self.proposal_costs: dict[int, float] = {}
        self._num_proposals: dict[int, int] = {}
        self.host_turn = 0.0  # seconds from a step's tokens read to the next launch (moving average)
        self._num_host_turns = 0

    @property
    def acceptance(self) -> float:
        """The estimated probability that a draft is accepted, given the drafts before it were."""
        return self._accepted / (self._accepted + self._rejected)

    def observe_step(self, num_rows: int, seconds: float, num_steps: int = 1) -> None:
        """A decode step of `num_rows` rows (its bucket's) took `seconds`, launch to tokens read; or a
        multi-step decode of `num_steps` steps did."""
        costs = self.costs if num_steps == 1 else self.multi_step_costs
        key = (num_steps > 1, num_rows)
        count = self._num_measured[key] = self._num_measured.get(key, 0) + 1
        seconds /= num_steps
        previous = costs.get(num_rows)
        retried = num_steps == 1 and num_rows in self._retrying
        costs[num_rows] = seconds if count <= 2 or retried else previous + _COST_WEIGHT * (seconds - previous)
        if num_steps == 1:
            self._measured_at[num_rows] = self._num_choices
            self._retrying.discard(num_rows)

    def observe_proposal(self, num_requests: int, seconds: float) -> None:
        """A round of proposals for `num_requests` running requests took `seconds`; a bucket's first is left
        out, as a bucket's first step is (it may have paid for compiles or first touches)."""
        bucket = self._bucket(num_requests)
        count = self._num_proposals[bucket] = self._num_proposals.get(bucket, 0) + 1
        previous = self.proposal_costs.get(bucket)
        if count == 2:
            self.proposal_costs[bucket] = seconds
        elif count > 2:
            self.proposal_costs[bucket] = previous + _COST_WEIGHT * (seconds - previous)

    def remeasure_proposals(self, num_requests: int) -> None:
        """The next round for `num_requests` requests replaces their bucket's round time rather than moving
        its average: the time is old (rounds stopped, `Scheduler.drafting`), and may have been a burst's."""
        bucket = self._bucket(num_requests)
        if bucket in self._num_proposals:
            self._num_proposals[bucket] = 1

    def proposal_cost(self, num_requests: int) -> float:
        """A round's time for `num_requests` requests: its bucket's, else the largest measured below it, else
        none (0: optimistic, so that a round runs and is measured)."""
        bucket = self._bucket(num_requests)
        below = [rows for rows in self.proposal_costs if rows <= bucket]
        return self.proposal_costs[max(below)] if below else 0.0

    def _bucket(self, num_requests: int) -> int:
        """The decode bucket that holds `num_requests` rows (the largest, past them all)."""
        index = bisect.bisect_left(self.row_buckets, num_requests)
        return self.row_buckets[min(index, len(self.row_buckets) - 1)]

    def observe_host_turn(self, seconds: float) -> None:
        """The host took `seconds` from a step's tokens, read at once, to the next launch (the first turn,
        after a start, is left out)."""
        self._num_host_turns += 1
        if self._num_host_turns == 2:
            self.host_turn = seconds
        elif self._num_host_turns > 2:
            self.host_turn += _COST_WEIGHT * (seconds - self.host_turn)

    def observe_verification(self, num_drafts: int, num_accepted: int) -> None:
        """A request's `num_drafts` drafts were verified and the first `num_accepted` accepted."""
        if num_drafts:
            self._observe(num_accepted, num_accepted < num_drafts)

    def observe_first_draft(self, accepted: bool) -> None:
        """A first draft that was not run matched (or not) the token then sampled."""
        self._observe(int(accepted), not accepted)

    def _observe(self, accepted: int, rejected: bool) -> None:
        self._accepted = self._accepted * _DECAY + accepted
        self._rejected = self._rejected * _DECAY + rejected

    def is_timed(self, num_requests: int) -> bool:
        """Whether the bucket that holds `num_requests` alone has a step time: `choose` can choose."""
        if num_requests > self.max_rows:
            return True  # (`choose` runs no draft then)
        return self.row_buckets[bisect.bisect_left(self.row_buckets, num_requests)] in self.costs

    def cost(self, num_rows: int) -> float | None:
        """A bucket's measured or assumed step time; None before any bucket up to it was measured. Assumed:
        the largest measured bucket's below it, where it has no time or one that is due a retry (`_is_due`)."""
        below = [rows for rows in self.costs if rows < num_rows]
        assumed = self.costs[max(below)] if below else None
        if num_rows not in self.costs:
            return assumed
        if assumed is not None and self._is_due(num_rows):
            return min(self.costs[num_rows], assumed)
        return self.costs[num_rows]

    def _is_due(self, num_rows: int) -> bool:
        """Whether a measured bucket's time is to be tried again: it is its first, or has gone unmeasured
        for its retry's number of choices."""
        if num_rows not in self._measured_at:
            return False  # a time given, not measured
        return (self._num_measured[(False, num_rows)] == 1
                or self._num_choices - self._measured_at[num_rows] >= self._retry_after.get(num_rows, _FIRST_RETRY))

    def can_pay(self, num_requests: int, max_drafts: int) -> bool:
        """Whether drafts could beat plain steps for `num_requests` requests even were every one of up to
        `max_drafts` a request accepted: where not, a proposer whose rounds cost (a draft model) is not asked.
        True while the requests' own bucket has no step time (`choose` decides then)."""
        if num_requests > self.max_rows:
            return False
        base = self.row_buckets[bisect.bisect_left(self.row_buckets, num_requests)]
        if base not in self.costs:
            return True
        base_rate = num_requests / self._plain_cost(base)
        for rows in self.row_buckets[self.row_buckets.index(base):]:
            num_slots = min(min(rows, self.max_rows) - num_requests, num_requests * max_drafts)
            if num_slots > 0 and (num_requests + num_slots) / self._drafting_cost(rows, num_requests) > base_rate:
                return True
        return False

    def _plain_cost(self, base: int) -> float:
        """A plain step of the `base` bucket (timed), per step: alone or as k steps in one call, the host's turn
        overlapped or not (module docstring)."""
        cost = min(self.costs[base], self.multi_step_costs.get(base, self.costs[base]))
        return max(cost, self.host_turn) if self.plain_overlaps else cost + self.host_turn

    def _drafting_cost(self, rows: int, num_requests: int) -> float:
        """A step of `rows` rows verifying the drafts of `num_requests` requests: its step time, the round that
        proposed them, the host's turn."""
        return self.cost(rows) + self.proposal_cost(num_requests) + self.host_turn

    def choose(self, proposals: list[list[int]]) -> list[int] | None:
        """How many of each request's proposed drafts to verify (prefixes), for the best bucket; None while
        the bucket that holds the requests alone has no measured step time."""
        self._num_choices += 1
        num_requests = len(proposals)
        kept = [0] * num_requests
        if num_requests > self.max_rows:
            return kept
        base = self.row_buckets[bisect.bisect_left(self.row_buckets, num_requests)]
        if base not in self.costs:
            return None
        base_cost = self._plain_cost(base)
        # Slots in the order they are filled: first drafts, then second drafts, ... (probability a^position)
        slots = [index for position in range(max(map(len, proposals), default=0))
                 for index, drafts in enumerate(proposals) if len(drafts) > position]
        acceptance = self.acceptance
        gains = [0.0]  # expected tokens of the first i slots
        position_of = [0] * num_requests
        for index in slots:
            position_of[index] += 1
            gains.append(gains[-1] + acceptance ** position_of[index])
        best_rate, best_slots, best_rows = num_requests / base_cost, 0, base
        for rows in self.row_buckets[self.row_buckets.index(base):]:
            num_slots = min(min(rows, self.max_rows) - num_requests, len(slots))
            rate = (num_requests + gains[num_slots]) / self._drafting_cost(rows, num_requests)
            if rate > best_rate:
                best_rate, best_slots, best_rows = rate, num_slots, rows
            if num_slots == len(slots) or rows >= self.max_rows:  # a larger bucket holds no more drafts
                break
        if best_rows in self.costs and best_rows != base:
            self._note_chosen(best_rows)
        for index in slots[:best_slots]:
            kept[index] += 1
        return kept

    def _note_chosen(self, num_rows: int) -> None:
        """A measured bucket was chosen: on its own time (its retries start again from the first), or on an
        assumed one (a retry: its next step replaces its time, and the next retry waits twice as long)."""
        if not self._is_due(num_rows) or self.cost(num_rows) == self.costs[num_rows]:
            self._retry_after[num_rows] = _FIRST_RETRY
            return
        self._retrying.add(num_rows)
        if self._num_measured[(False, num_rows)] > 1:  # (a first time's retry is not one of the doublings)
            self._retry_after[num_rows] = min(2 * self._retry_after.get(num_rows, _FIRST_RETRY), _MAX_RETRY)
