"""The plan of one training step (trainer/plan.py), for any rows, workers and budgets.

Read back from the micro-batches it hands out: every row trains exactly once, in the minibatch
``minibatches`` gives it; every worker runs the same number of micro-batches per minibatch;
a micro-batch stays within the token budget unless it is one row longer than it; and the
per-minibatch totals (loss tokens, and rows holding any loss token: the denominators of a
token mean and of a sequence mean) are those of the minibatch's rows over all workers.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.plan import minibatches, plan_step
from trainer.rollouts import Sample


@st.composite
def samples(draw) -> list[Sample]:
    out = []
    for i in range(draw(st.integers(1, 12))):
        length = draw(st.integers(1, 40))
        mask = draw(st.lists(st.sampled_from([0, 1]), min_size=length, max_size=length))
        ids = [i * 1000 + j for j in range(length)]  # the ids name the row: read back below
        out.append(
            Sample(
                session_id=f"s{i}",
                input_ids=ids,
                loss_mask=mask,
                behaviour=[-1.0] * length,
                versions=[0] * length,
                advantages=[1.0] * length,
            )
        )
    return out


@settings(max_examples=200, deadline=None)
@given(
    rows=samples(),
    world_size=st.integers(1, 4),
    minibatch_count=st.integers(1, 4),
    max_tokens=st.integers(1, 64),
)
def test_the_plan_trains_every_row_once_and_counts_each_minibatch(
    rows, world_size, minibatch_count, max_tokens
):
    plan = plan_step(rows, world_size, minibatch_count, max_tokens)
    expected = minibatches(len(rows), minibatch_count)
    assert len(plan.per_rank) == world_size
    assert len(plan.tokens) == len(plan.sequences) == len(expected)
    for m, indices in enumerate(expected):
        depths = {len(per_minibatch[m]) for per_minibatch in plan.per_rank}
        assert len(depths) == 1  # every worker runs as many micro-batches
        trained = []
        for per_minibatch in plan.per_rank:
            for micro in per_minibatch[m]:
                lengths = [len(row) for row in micro.rows]
                assert sum(lengths) <= max_tokens or len(lengths) == 1
                trained += [row[0] // 1000 for row in micro.rows]
                assert micro.loss_mask == [rows[row[0] // 1000].loss_mask for row in micro.rows]
        assert sorted(trained) == indices
        chosen = [rows[i] for i in indices]
        assert plan.tokens[m] == sum(sum(r.loss_mask) for r in chosen)
        assert plan.sequences[m] == sum(1 for r in chosen if any(r.loss_mask))
