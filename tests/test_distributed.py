"""A launcher's world size is never ignored: the launcher variables, the one-line errors, and (slow) real
2-process torchrun runs of training, bulk sampling and FSDP without ``train.cpu`` / ``--device``."""

import pytest

from sit_vit5.distributed import LaunchError, check_group, describe_group, launcher_world_size


def test_launcher_world_size_reads_the_variables_accelerate_reads():
    assert launcher_world_size({}) == (1, None)
    assert launcher_world_size({"WORLD_SIZE": "2", "PMI_SIZE": "8"}) == (2, "WORLD_SIZE")
    assert launcher_world_size({"OMPI_COMM_WORLD_SIZE": "4"}) == (4, "OMPI_COMM_WORLD_SIZE")
    for bad in ("two", "0"):
        with pytest.raises(LaunchError, match=f"WORLD_SIZE={bad!r}|WORLD_SIZE=0"):
            launcher_world_size({"WORLD_SIZE": bad})


@pytest.mark.parametrize("environ, group, words", [
    ({"WORLD_SIZE": "2"}, 1, ["WORLD_SIZE=2", "RANK/LOCAL_RANK", "torchrun", "unset WORLD_SIZE"]),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, 1, ["WORLD_SIZE=2", "group of 1", "MASTER_ADDR"]),
    ({"PMI_SIZE": "4"}, 2, ["PMI_SIZE=4", "group of 2"]),
    ({}, 2, ["group of 2", "WORLD_SIZE", "torchrun"]),
])
def test_a_group_that_differs_from_the_launcher_is_a_one_line_error(environ, group, words):
    with pytest.raises(LaunchError) as err:
        check_group(group, cpu=True, environ=environ)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_matching_groups_pass_and_the_header_names_size_and_backend():
    check_group(1, cpu=True, environ={})
    check_group(2, cpu=True, environ={"WORLD_SIZE": "2", "RANK": "1"})
    assert describe_group(1, "cpu") == "1 process(es) (backend none), cpu"
