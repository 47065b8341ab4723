import pytest

from lightning_par.topology import Topology


def test_auto_model_axis_takes_every_device():
    assert Topology.resolve(4, model_axis="pp", pipeline_parallel_size="auto").shape == (4, 1, 1)
    assert Topology.resolve(4, model_axis="tp", tensor_parallel_size="auto").shape == (1, 1, 4)


def test_auto_data_parallel_fills_the_rest():
    t = Topology.resolve(8, pipeline_parallel_size=2, tensor_parallel_size=2)
    assert (t.pipeline_parallel_size, t.data_parallel_size, t.tensor_parallel_size) == (2, 2, 2)


def test_coordinates_round_trip_and_groups():
    t = Topology(data_parallel_size=2, pipeline_parallel_size=2, tensor_parallel_size=2)
    for rank in range(8):
        assert t.rank_of(**t.coordinates(rank)) == rank
    assert t.group_ranks("tp", 0) == [0, 1]
    assert t.group_ranks("dp", 0) == [0, 2]
    assert t.group_ranks("pp", 0) == [0, 4]
    groups = t.all_groups("dp")
    assert sorted(r for g in groups for r in g) == list(range(8))


def test_sizes_not_multiplying_to_world_size_name_every_value():
    with pytest.raises(ValueError, match=r"data_parallel_size=3.*pipeline_parallel_size=2.*world size \(4\)"):
        Topology.resolve(4, data_parallel_size=3, pipeline_parallel_size=2)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "two"])
def test_bad_sizes_are_rejected(bad):
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        Topology.resolve(2, pipeline_parallel_size=bad)
