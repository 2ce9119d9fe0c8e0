"""The adapter placement policy (pure function behind the Serve router)."""

from app.routing.placement import ReplicaView, rank_replicas


def view(rid, resident=(), free=1, ongoing=0, max_ongoing=10, batch=4, age=0.0):
    return ReplicaView(rid, frozenset(resident), free, ongoing, max_ongoing, batch, age)


def flat(ranks):
    return [r for rank in ranks for r in rank]


def test_a_holder_with_batch_room_comes_first_oldest_first_one_per_rank():
    ranks = rank_replicas("a", [view("new", ["a"], ongoing=0, age=2), view("old", ["a"], ongoing=3, age=1),
                                view("other", free=3, age=0)])
    assert ranks[:2] == [["old"], ["new"]]  # packed: Serve picks the shortest queue within a rank
    assert ranks[2] == ["other"]


def test_a_cold_adapter_joins_packed_work_and_leaves_idle_replicas_idle():
    ranks = rank_replicas("cold", [view("idle-new", free=4, age=3), view("busy-old", free=1, ongoing=2, age=1),
                                   view("nofree", free=0, ongoing=1, age=0)])
    assert flat(ranks) == ["busy-old", "idle-new", "nofree"]  # evicting is the last resort with room


def test_a_hot_adapter_spreads_when_its_holders_batches_are_full():
    ranks = rank_replicas("hot", [view("h", ["hot"], free=0, ongoing=4, age=0), view("f", free=2, ongoing=1, age=1)])
    assert ranks[0] == ["f"]
    assert "h" in ranks[1]  # its queue still accepts


def test_the_base_model_packs_onto_the_oldest_replica_with_batch_room():
    ranks = rank_replicas(None, [view("r2", ongoing=1, age=2), view("r1", ongoing=4, age=1), view("r0", ongoing=2, age=0)])
    assert ranks[0] == ["r0"] and ranks[1] == ["r2"]  # r1's batch is full: after both
    assert ranks[-1] == ["r1"]


def test_replicas_with_full_batches_are_least_loaded_first_and_full_queues_last():
    replicas = [view("q9", ongoing=9, age=0), view("q5", ongoing=5, age=1), view("full", ongoing=10, age=2)]
    assert rank_replicas(None, replicas) == [["q5", "q9"], ["full"]]


def test_every_replica_is_ranked_exactly_once(seed):
    import random

    rng = random.Random(seed)
    for _ in range(200):
        replicas = [view(f"r{i}", rng.sample(["x", "y"], rng.randint(0, 2)), free=rng.randint(0, 2),
                         ongoing=rng.randint(0, 10), batch=rng.randint(1, 8), age=rng.random()) for i in range(6)]
        got = flat(rank_replicas(rng.choice(["x", "z", None]), replicas))
        assert sorted(got) == sorted(r.replica_id for r in replicas)


def test_without_a_reported_batch_capacity_the_queue_bound_is_the_batch():
    r = ReplicaView("r", max_ongoing=3, ongoing=2)
    assert r.has_batch_room and not ReplicaView("r", max_ongoing=3, ongoing=3).has_batch_room


def test_no_replicas():
    assert rank_replicas("a", []) == []


def test_a_replica_whose_adapters_are_all_in_use_is_not_where_a_cold_adapter_loads():
    busy = ReplicaView("busy", frozenset({"a", "b"}), 0, 1, 10, 4, 0.0, loadable_slots=0)
    idle_slot = ReplicaView("lru", frozenset({"c"}), 0, 2, 10, 4, 1.0, loadable_slots=1)
    ranks = rank_replicas("cold", [busy, idle_slot])
    assert ranks[0] == ["lru"] and ranks[1] == ["busy"]


def test_a_replica_batching_max_loras_other_adapters_has_no_room_for_one_more():
    full_of_others = ReplicaView("old", frozenset({"a", "b", "x"}), 1, 2, 10, 8, 0.0, 3, frozenset({"a", "b"}), 2)
    other = ReplicaView("new", frozenset(), 4, 0, 10, 8, 1.0, 4, frozenset(), 2)
    assert rank_replicas("x", [full_of_others, other])[0] == ["new"]  # x is resident on old, unusable there
    assert rank_replicas("a", [full_of_others, other])[0] == ["old"]  # a is batched there already


def test_views_count_adapters_sent_since_the_last_report_as_taking_slots():
    from app.routing.placement import view_from_stats

    stats = {"resident": ["a"], "free_slots": 2, "loadable_slots": 3, "active": ["a"], "max_loras": 4,
             "batch_capacity": 8, "started_at": 5.0}
    v = view_from_stats("r", stats, ongoing=3, max_ongoing=16, recently_sent=frozenset({"a", "b", "c"}))
    assert v.resident == {"a", "b", "c"} and v.free_slots == 0 and v.loadable_slots == 1
    assert v.active == {"a", "b", "c"} and v.max_loras == 4 and v.batch_capacity == 8
def test_replica_with_a_dead_engine_gets_nothing_while_another_is_alive():
    dead = ReplicaView("dead", frozenset(["a"]), 3, 0, 10, alive=False)
    for adapter in ("a", "cold", None):
        ranks = rank_replicas(adapter, [dead, view("r2", ongoing=9)])
        assert [r for rank in ranks for r in rank] == ["r2"], adapter
    assert rank_replicas("a", [dead]) == [["dead"]]  # none alive: it answers 503 itself
