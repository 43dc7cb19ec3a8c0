"""The draft policy: no drafts before the running requests' bucket is timed, drafts in a bucket's padding
rows for free, a larger bucket only where its expected tokens per second beat the smaller's, slots filled
position by position, an untimed bucket tried, a bucket's slow time retried at doubling intervals, an
acceptance estimate that follows verifications and the first drafts of requests whose drafts did not run,
and a proposal's own time."""

import pytest

from jaxserve.engine.draft_policy import DraftPolicy


def policy_with(costs: dict[int, float], acceptance_runs: tuple[int, int] = (0, 0)) -> DraftPolicy:
    """A policy whose buckets were each measured twice at `costs` (settled: a first time alone is retried)."""
    policy = DraftPolicy((1, 4, 16, 64), max_rows=64)
    for rows, seconds in costs.items():
        policy.observe_step(rows, seconds)
        policy.observe_step(rows, seconds)
    accepted, rejected = acceptance_runs
    for _ in range(accepted):
        policy.observe_first_draft(True)
    for _ in range(rejected):
        policy.observe_first_draft(False)
    return policy


def test_nothing_runs_before_the_base_bucket_is_timed():
    assert policy_with({}).choose([[1, 2, 3]]) is None
    assert policy_with({4: 0.01}).choose([[1, 2, 3]]) is None, "one request's bucket is 1, not timed"


def test_padding_rows_of_the_base_bucket_take_drafts_for_free():
    """Three requests run in the 4-row bucket either way: its fourth row takes a first draft, even at a
    low acceptance, and the costly 16-row bucket is not chosen."""
    policy = policy_with({4: 0.010, 16: 0.040}, acceptance_runs=(1, 30))
    assert policy.choose([[7, 8], [], [9]]) == [1, 0, 0]


@pytest.mark.parametrize("accepted, rejected, want", [(40, 0, [3]), (0, 40, [0])])
def test_a_larger_bucket_runs_only_where_it_pays(accepted, rejected, want):
    """One request: the 4-row bucket costs 1.4x the 1-row one, the 16-row 5.4x. Three drafts pay at a high
    acceptance (1 + a + a^2 + a^3 close to 4 tokens) and not at a low one; four never do."""
    policy = policy_with({1: 0.0065, 4: 0.0093, 16: 0.035}, acceptance_runs=(accepted, rejected))
    assert policy.choose([[5, 6, 7, 8]]) == want


def test_slots_fill_position_by_position():
    """Two requests, the 4-row bucket: the two spare rows go to each request's first draft, not to one
    request's first two."""
    policy = policy_with({4: 0.01, 16: 0.04}, acceptance_runs=(40, 0))
    assert policy.choose([[1, 2, 3], [4, 5, 6]]) == [1, 1]


def test_an_untimed_bucket_is_assumed_as_cheap_as_the_largest_timed_below_it():
    policy = policy_with({1: 0.006}, acceptance_runs=(40, 0))
    assert policy.cost(4) == policy.cost(16) == 0.006 and policy.cost(1) == 0.006
    assert policy.choose([[1, 2, 3]]) == [3], "tried"
    policy.observe_step(4, 0.030)  # measured: 5x the 1-row step for at most 4 tokens
    assert policy.choose([[1, 2, 3]]) == [3], "a first time alone may have paid for first touches: tried again"
    policy.observe_step(4, 0.030)
    assert policy.choose([[1, 2, 3]]) == [0]


def test_a_bucket_timed_slow_by_a_burst_is_tried_again_and_its_new_time_replaces_the_old():
    """The 4-row bucket was timed twice during a burst of load (0.2 s against 0.007 s): it is not chosen,
    so not measured, until 16 choices have passed; then it is tried, and its one new time replaces the old."""
    policy = policy_with({1: 0.006, 4: 0.2}, acceptance_runs=(40, 0))
    assert [policy.choose([[1, 2, 3]]) for _ in range(15)] == [[0]] * 15
    assert policy.choose([[1, 2, 3]]) == [3], "the 16th choice retries it"
    policy.observe_step(4, 0.007)
    assert policy.costs[4] == 0.007
    assert [policy.choose([[1, 2, 3]]) for _ in range(100)] == [[3]] * 100, "chosen from then on"


def test_a_bucket_that_really_costs_too_much_is_retried_ever_more_rarely():
    """A 4-row bucket that costs 5x the 1-row one every time it is tried: retried after 16 choices, then 32,
    64, ... up to 1,024, so a few steps wasted over thousands of choices."""
    policy = policy_with({1: 0.006, 4: 0.030}, acceptance_runs=(40, 0))
    retries = []
    for choice in range(1, 5001):
        if policy.choose([[1, 2, 3]]) == [3]:
            retries.append(choice)
            policy.observe_step(4, 0.030)
    gaps = [later - earlier for earlier, later in zip([0, *retries], retries, strict=False)]
    assert gaps[:7] == [16, 32, 64, 128, 256, 512, 1024], gaps
    assert all(gap == 1024 for gap in gaps[7:]) and len(retries) == 9, retries


def test_the_acceptance_follows_the_recent_verifications():
    policy = DraftPolicy((1, 4), max_rows=4)
    assert policy.acceptance == 0.5  # the prior
    for _ in range(50):
        policy.observe_verification(num_drafts=4, num_accepted=4)  # runs that never ended in a rejection
    assert policy.acceptance > 0.99
    for _ in range(300):
        policy.observe_verification(num_drafts=3, num_accepted=0)
    assert policy.acceptance < 0.01, "old observations fade"
    policy.observe_verification(num_drafts=0, num_accepted=0)  # nothing verified: nothing learned
    assert policy.acceptance < 0.01


def test_a_step_never_has_more_rows_than_the_limit():
    """The runner's buckets go to 16 for 8 rows at most (max_num_batched_tokens under max_num_seqs): the
    drafts stop at 8 rows, and more requests than rows get none."""
    policy = DraftPolicy((1, 4, 16), max_rows=8)
    for rows in (1, 4, 16):
        policy.observe_step(rows, 0.01)
    for _ in range(40):
        policy.observe_first_draft(True)
    assert sum(policy.choose([[1, 2, 3, 4]] * 3)) == 5
    assert policy.choose([[1]] * 9) == [0] * 9


def test_a_bucket_s_first_time_is_replaced_by_its_second():
    policy = DraftPolicy((1, 4), max_rows=4)
    policy.observe_step(4, 0.5)  # a first run's extra work
    assert policy.costs[4] == 0.5
    policy.observe_step(4, 0.010)
    assert policy.costs[4] == 0.010
    policy.observe_step(4, 0.020)
    assert 0.010 < policy.costs[4] < 0.020, "a moving average from then on"


def test_drafts_compete_with_multi_step_decoding_s_time_per_step():
    """With k steps per call a plain decode costs 4 ms a step instead of 7: three drafts at 10 ms no longer
    pay at a middling acceptance."""
    policy = policy_with({1: 0.007, 4: 0.010, 16: 0.040}, acceptance_runs=(12, 8))
    assert policy.choose([[5, 6, 7]]) == [3]
    policy.observe_step(1, 0.032, num_steps=8)
    policy.observe_step(1, 0.032, num_steps=8)
    assert policy.multi_step_costs[1] == 0.004
    assert policy.choose([[5, 6, 7]]) == [0]


@pytest.mark.parametrize("proposal_seconds, want", [(0.0, [1, 0, 0]), (0.004, [0, 0, 0])])
def test_the_proposal_s_own_time_counts_against_its_drafts(proposal_seconds, want):
    """A draft model's round is not free: a padding row's first draft, worth a^1 = 0.5 tokens beside three
    requests' 3, pays at no proposal cost and not at 0.004 s against the 0.010 s step (3.5 / 0.014 < 3 / 0.010).
    The first round's time is left out, as a bucket's first step is."""
    policy = policy_with({4: 0.010, 16: 0.040}, acceptance_runs=(30, 30))
    policy.observe_proposal(3, 1.0)  # the first: compiles, first touches
    policy.observe_proposal(3, proposal_seconds)
    assert policy.proposal_cost(3) == proposal_seconds
    assert policy.choose([[7, 8], [], [9]]) == want


def test_is_timed_says_whether_choose_can_choose():
    policy = policy_with({4: 0.01})
    assert policy.is_timed(3) and policy.is_timed(4)
    assert not policy.is_timed(1) and not policy.is_timed(5)
    assert policy.is_timed(65)  # past every bucket: `choose` runs no draft, and needs no time
    assert (policy.choose([[1]] * 3) is None) == (not policy.is_timed(3))


@pytest.mark.parametrize("host_seconds, overlaps, want", [(0.0, True, [3]), (0.010, True, [0]), (0.010, False, [3])])
def test_the_host_s_turn_counts_against_drafts_where_plain_steps_hide_it(host_seconds, overlaps, want):
    """One request at acceptance 1/2: three drafts give 1.875 tokens in the 4-row bucket's 0.014 s against one
    in the 1-row bucket's 0.010 s. A 0.010 s host turn is paid by a drafting step (read at once), and hidden
    behind a plain step's under async scheduling (1.875 / 0.024 < 1 / 0.010), not without it
    (1.875 / 0.024 > 1 / 0.020)."""
    policy = DraftPolicy((1, 4, 16), max_rows=16, plain_overlaps=overlaps)
    for rows, seconds in {1: 0.010, 4: 0.014, 16: 0.05}.items():
        policy.observe_step(rows, seconds)
    for seconds in (1.0, host_seconds):  # the first turn is left out
        policy.observe_host_turn(seconds)
    assert policy.host_turn == host_seconds
    assert policy.choose([[5, 6, 7]]) == want


def test_a_proposer_is_asked_only_where_its_drafts_could_pay():
    """Three requests, three drafts each: the 16-row bucket at 0.02 s gives at most 12 tokens. With rounds of
    0.03 s they cannot beat the 4-row bucket's 3 tokens in 0.01 s even all accepted (12 / 0.05 < 3 / 0.01);
    with free rounds they could. An untimed bucket leaves the choice to `choose`."""
    policy = policy_with({4: 0.010, 16: 0.020})
    assert policy.can_pay(3, 3)
    for seconds in (1.0, 0.03):
        policy.observe_proposal(3, seconds)
    assert not policy.can_pay(3, 3)
    assert policy.can_pay(1, 3) and policy.proposal_cost(1) == 0.0  # a round for one request: not measured
    assert policy.proposal_cost(16) == 0.03  # the largest measured below
    assert policy.choose([[1, 2, 3]] * 3) == [0, 0, 0]  # (at any acceptance)
    assert policy_with({16: 0.02}).can_pay(3, 3)  # the 4-row bucket untimed
    assert not policy.can_pay(65, 3)  # past every bucket
