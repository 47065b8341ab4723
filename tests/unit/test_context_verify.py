"""What the setup check of a context-parallel block runs on: the first block of each class of the stack."""
from torch import nn

from lightning_par.context.verify import block_kinds


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Conv1d(4, 4, 1), nn.Linear(4, 4)])


def test_block_kinds_names_the_first_block_of_each_class():
    assert block_kinds(Mixed(), "layers") == ["layers.0", "layers.2"]


def test_block_kinds_of_a_stack_of_one_class_is_its_first_block():
    stack = nn.Sequential(*(nn.Linear(4, 4) for _ in range(3)))
    assert block_kinds(nn.ModuleDict({"blocks": stack})) == ["blocks.0"]
