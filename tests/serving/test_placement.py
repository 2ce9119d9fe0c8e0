"""The adapter placement policy (pure function behind the Serve router)."""

from app.routing.placement import ReplicaView, rank_replicas


def view(rid, resident=(), free=1, ongoing=0, max_ongoing=10):
    return ReplicaView(rid, frozenset(resident), free, ongoing, max_ongoing)


def test_holder_with_headroom_first_least_loaded():
    ranks = rank_replicas("a", [view("r1", ["a"], ongoing=3), view("r2", ["a"], ongoing=1), view("r3", free=3)])
    assert ranks[0] == ["r2", "r1"]
    assert ranks[1] == ["r3"]


def test_cold_adapter_packs_onto_busiest_replica_with_a_free_slot():
    ranks = rank_replicas("cold", [view("idle", free=4, ongoing=0), view("busy", free=1, ongoing=6), view("nofree", free=0, ongoing=2)])
    assert ranks[0][0] == "busy"
    assert ranks[-1][-1] == "nofree"  # evicting is the last resort among open replicas


def test_hot_adapter_spreads_to_replicas_with_free_slots():
    ranks = rank_replicas("hot", [view("h", ["hot"], free=0, ongoing=8), view("f1", free=2, ongoing=1), view("f2", free=0, ongoing=0)])
    assert ranks[0] == ["h", "f1"]


def test_full_holder_is_not_preferred_over_open_replicas():
    ranks = rank_replicas("a", [view("full", ["a"], ongoing=10), view("open", free=1)])
    assert ranks[0] == ["open"]
    assert ranks[-1] == ["full"]


def test_base_model_goes_to_least_loaded_and_every_replica_appears_once():
    replicas = [view(f"r{i}", ongoing=i) for i in range(5)]
    ranks = rank_replicas(None, replicas)
    flat = [r for rank in ranks for r in rank]
    assert flat[0] == "r0" and sorted(flat) == sorted(r.replica_id for r in replicas)
    assert all(len(rank) <= 2 for rank in ranks)


def test_every_replica_is_ranked_exactly_once_for_adapters():
    replicas = [view("a", ["x"], free=0, ongoing=2), view("b", free=2, ongoing=9), view("c", free=0, ongoing=10), view("d", ["x"], ongoing=10)]
    flat = [r for rank in rank_replicas("x", replicas) for r in rank]
    assert sorted(flat) == ["a", "b", "c", "d"] and len(flat) == 4


def test_no_replicas():
    assert rank_replicas("a", []) == []


def test_replica_with_a_dead_engine_gets_nothing_while_another_is_alive():
    dead = ReplicaView("dead", frozenset(["a"]), 3, 0, 10, alive=False)
    for adapter in ("a", "cold", None):
        ranks = rank_replicas(adapter, [dead, view("r2", ongoing=9)])
        assert [r for rank in ranks for r in rank] == ["r2"], adapter
    assert rank_replicas("a", [dead]) == [["dead"]]  # none alive: it answers 503 itself
