"""Which groups of trainable sessions a claim takes or drops (server.store.groups), and the drop
reasons the store writes (server.store.drop_reasons). Pure: no database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from server.store import drop_reasons
from server.store.groups import Candidate, GroupRule, form_groups, group_key, plan_claim
from server.store.tables import DROP_REASON_LENGTH

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
TRAIN = GroupRule(size=3, timeout_s=60.0, on_incomplete="train")
DROP = GroupRule(size=3, timeout_s=60.0, on_incomplete="drop")
NO_SIZE = GroupRule(size=1, timeout_s=60.0, on_incomplete="drop")  # a run without group_size


def session(sid: str, age_s: float, group: str | None = None, task: str | None = None):
    """A session that became trainable ``age_s`` seconds before NOW."""
    return Candidate(sid, group, task, NOW - timedelta(seconds=age_s))


def claimed(plan) -> list[list[str]]:
    return [sorted(group.session_ids) for group in plan.claim]


def dropped(plan) -> dict[str, str]:
    return {sid: reason for group, reason in plan.drop for sid in group.session_ids}


def test_a_group_id_and_a_task_id_spelled_alike_are_different_groups():
    a, b, c = session("a", 1, group="x"), session("b", 1, task="x"), session("c", 1, "x", "y")
    assert group_key(a, True) == group_key(c, True) == ("group", "x")
    assert group_key(b, True) == ("task", "x")
    assert group_key(session("d", 1), True) is None
    formed = form_groups([a, b, c], by_task=True)
    assert sorted(sorted(g.session_ids) for g in formed) == [["a", "c"], ["b"]]


def test_only_a_group_size_above_1_groups_by_task():
    assert TRAIN.by_task and not NO_SIZE.by_task
    task_only = [session("a", 1, task="t"), session("b", 1, task="t"), session("c", 1, "g", "t")]
    assert group_key(task_only[0], False) is None
    formed = form_groups(task_only, by_task=False)
    assert sorted(sorted(g.session_ids) for g in formed) == [["a"], ["b"], ["c"]]


def test_a_full_group_is_claimed_and_a_young_incomplete_one_waits():
    plan = plan_claim(
        [*(session(f"g{i}", 5, group="g") for i in range(3)), session("h", 5, group="h")],
        TRAIN,
        10,
        NOW,
    )
    assert claimed(plan) == [["g0", "g1", "g2"]] and dropped(plan) == {}


def test_sessions_with_only_a_task_id_group_by_task():
    plan = plan_claim([session(f"t{i}", 5, task="t") for i in range(3)], TRAIN, 10, NOW)
    assert claimed(plan) == [["t0", "t1", "t2"]]


def test_an_incomplete_group_is_claimed_or_dropped_after_the_group_timeout():
    late = [session("a", 61, group="g"), session("b", 2, group="g")]
    assert claimed(plan_claim(late, TRAIN, 10, NOW)) == [["a", "b"]]
    plan = plan_claim(late, DROP, 10, NOW)
    assert claimed(plan) == []
    reason = dropped(plan)["a"]
    assert reason == dropped(plan)["b"]
    assert reason.startswith("incomplete_group: group 'g' had 2 of group_size 3 sessions")
    assert "after 61 s (group_timeout_s 60 s)" in reason


def test_without_a_group_timeout_an_incomplete_group_waits_forever():
    forever = GroupRule(size=3, timeout_s=None, on_incomplete="drop")
    plan = plan_claim([session("a", 10**7, group="g")], forever, 10, NOW)
    assert claimed(plan) == [] and dropped(plan) == {}


def test_a_session_without_a_key_is_claimed_or_dropped_at_once():
    alone = [session("a", 0), session("b", 0)]
    assert claimed(plan_claim(alone, TRAIN, 10, NOW)) == [["a"], ["b"]]
    reasons = dropped(plan_claim(alone, DROP, 10, NOW))
    assert set(reasons) == {"a", "b"}
    assert reasons["a"].startswith("no_group: the session has neither group_id nor task_id")


def test_without_a_group_size_a_group_id_comes_whole_at_once_and_the_rest_alone():
    """No group_size: a group_id's trainable sessions are claimed together at once, however
    few or many and even beyond max_sessions when first; task-only and keyless sessions one by
    one (never dropped, whatever on_incomplete_group says)."""
    grouped = [session(f"g{i}", 30, group="g", task="t") for i in range(3)]
    task_only = [session(f"t{i}", 20, task="t") for i in range(2)]
    alone = session("z", 10)
    plan = plan_claim([alone, *task_only, *grouped], NO_SIZE, 2, NOW)
    assert claimed(plan) == [["g0", "g1", "g2"]] and dropped(plan) == {}
    plan = plan_claim([alone, *task_only], NO_SIZE, 2, NOW)
    assert claimed(plan) == [["t0"], ["t1"]]
    assert claimed(plan_claim([alone, session("h", 0, group="h")], NO_SIZE, 10, NOW)) == [
        ["z"],
        ["h"],
    ]


def test_a_claim_that_already_holds_sessions_takes_only_groups_that_fit():
    mid = [session(f"m{i}", 20, group="mid") for i in range(4)]
    assert claimed(plan_claim(mid, TRAIN, 5, NOW, already=2)) == []
    assert claimed(plan_claim(mid, TRAIN, 6, NOW, already=2)) == [["m0", "m1", "m2", "m3"]]


def test_groups_go_oldest_first_whole_and_stop_at_the_first_that_does_not_fit():
    old = [session(f"o{i}", 30, group="old") for i in range(3)]
    mid = [session(f"m{i}", 20, group="mid") for i in range(4)]  # larger than group_size: whole
    new = [session(f"n{i}", 10, group="new") for i in range(3)]
    assert claimed(plan_claim([*new, *mid, *old], TRAIN, 7, NOW)) == [
        ["o0", "o1", "o2"],
        ["m0", "m1", "m2", "m3"],
    ]
    assert claimed(plan_claim([*new, *mid, *old], TRAIN, 6, NOW)) == [["o0", "o1", "o2"]]
    # The first group is claimed whole even when it is larger than max_sessions.
    assert claimed(plan_claim(mid, TRAIN, 2, NOW)) == [["m0", "m1", "m2", "m3"]]


def test_a_group_is_as_old_as_its_newest_session():
    straggler = [session("s0", 100, group="s"), session("s1", 100, group="s")]
    straggler.append(session("s2", 1, group="s"))
    steady = [session(f"t{i}", 50, group="t") for i in range(3)]
    assert claimed(plan_claim([*straggler, *steady], TRAIN, 3, NOW)) == [["t0", "t1", "t2"]]


def test_drop_reasons_are_a_code_a_colon_and_a_sentence_that_fits():
    reasons = [
        drop_reasons.NO_TURNS,
        drop_reasons.no_reward(600.0),
        drop_reasons.no_group(4),
        drop_reasons.incomplete_group("group 'x'", 1, 4, 600.25, 600.0),
        drop_reasons.incomplete_group("group " + "x" * 600, 1, 4, 1.0, 1.0),
    ]
    for reason in reasons:
        code, sentence = reason.split(": ", 1)
        assert code.isidentifier() and sentence
        assert len(reason) <= DROP_REASON_LENGTH
    assert reasons[1].startswith("no_reward: no session reward within reward_timeout_s (600 s)")


@st.composite
def candidates(draw) -> list[Candidate]:
    out = []
    for index in range(draw(st.integers(0, 25))):
        group = draw(st.sampled_from([None, "g1", "g2", "g3"]))
        task = draw(st.sampled_from([None, "g1", "t2"]))
        out.append(session(f"s{index:02d}", draw(st.integers(0, 120)), group, task))
    return out


@settings(max_examples=300, deadline=None)
@given(
    candidates(),
    st.integers(1, 10),
    st.integers(1, 4),
    st.sampled_from(["train", "drop"]),
    st.sampled_from([None, 30.0, 90.0]),
    st.integers(0, 3),
)
def test_every_plan_takes_whole_groups_each_session_at_most_once(
    found, max_sessions, size, on_incomplete, timeout_s, already
):
    """Whatever the group size (1: none), plans never split a group (by group_id, and by
    task_id only above 1), take no session twice, stay within max_sessions unless the first
    group alone is larger, and go oldest first (by a group's newest session)."""
    rule = GroupRule(size, timeout_s, on_incomplete)
    plan = plan_claim(found, rule, max_sessions, NOW, already=already)
    taken = [sid for group in plan.claim for sid in group.session_ids]
    gone = list(dropped(plan))
    assert len(set(taken)) == len(taken) and not set(taken) & set(gone)
    members: dict[tuple[str, str], set[str]] = {}
    for c in found:
        if c.group_id is not None:
            key = ("group", c.group_id)
        elif size > 1 and c.task_id is not None:
            key = ("task", c.task_id)
        else:
            key = ("alone", c.session_id)
        members.setdefault(key, set()).add(c.session_id)
    for group in [*plan.claim, *(group for group, _ in plan.drop)]:
        key = group.key or ("alone", group.session_ids[0])
        assert set(group.session_ids) == members[key]  # never split
    if len(plan.claim) > 1 or (already and plan.claim):  # only a first group may be too big
        assert already + len(taken) <= max_sessions
    newest = [group.newest for group in plan.claim]
    assert newest == sorted(newest)
    if size == 1:  # every group complete at once: everything is claimable, nothing dropped
        assert plan.drop == []
        if not already:
            assert plan.claim or not found
    elif on_incomplete == "drop":
        assert all(len(group.members) >= size for group in plan.claim)
    else:
        assert plan.drop == []
