"""Flattening of call arguments and outputs."""

from __future__ import annotations

import collections
from typing import NamedTuple

import pytest
import torch

from lightning_ort.engine.signature import FlatInputs, FlatOutputs, TensorMeta
from tests.zoo import ModelOutput


class Point(NamedTuple):
    x: torch.Tensor
    y: float


def test_inputs_round_trip_with_nesting_and_constants() -> None:
    a, b, c = torch.ones(1), torch.zeros(2), torch.full((3,), 2.0)
    args = ([a, {"inner": b}], Point(c, 1.5))
    kwargs = {"flag": True, "nothing": None, "dtype": torch.float16}
    flat = FlatInputs.from_call(["items", "point"], args, kwargs)
    assert [t is s for t, s in zip(flat.tensors, (a, b, c))] == [True] * 3
    rebuilt_args, rebuilt_kwargs = flat.rebuild(flat.tensors)
    assert rebuilt_kwargs == kwargs
    assert isinstance(rebuilt_args[1], Point) and rebuilt_args[1].y == 1.5
    assert rebuilt_args[0][1]["inner"] is b


def test_structure_distinguishes_values_and_types() -> None:
    def structure(*args: object) -> object:
        return FlatInputs.from_call([], args, {}).structure

    assert structure(torch.ones(1), True) != structure(torch.ones(1), False)
    assert structure(torch.ones(1), 1) != structure(torch.ones(1), True)
    assert structure(torch.ones(1), 2.0) == structure(torch.zeros(5), 2.0)
    hash(structure(torch.ones(1), [1, 2], {"a": None}))


def test_unsupported_leaf_names_its_path() -> None:
    with pytest.raises(TypeError, match=r"argument `batch\['ids'\]\[0\]` of type str"):
        FlatInputs.from_call(["batch"], ({"ids": ["a"]},), {})
    with pytest.raises(TypeError, match=r"`args\[2\]`"):
        FlatInputs.from_call(["x"], (torch.ones(1), 1, object()), {})


def test_outputs_rebuild_dataclass_namedtuple_ordered_dict() -> None:
    t1, t2 = torch.ones(1), torch.zeros(1)
    output = (ModelOutput(logits=t1, hidden_states=(t2,)), collections.OrderedDict(k=3), Point(t2, 2.0))
    flat = FlatOutputs.from_output(output)
    assert len(flat.tensors) == 3
    rebuilt = flat.rebuild([t * 5 for t in flat.tensors])
    assert isinstance(rebuilt[0], ModelOutput) and rebuilt[0].loss is None
    assert torch.equal(rebuilt[0].logits, t1 * 5)
    assert rebuilt[1] == collections.OrderedDict(k=3)
    assert isinstance(rebuilt[2], Point) and rebuilt[2].y == 2.0


def test_tensor_meta_records_what_decides_the_graph() -> None:
    meta = TensorMeta.of(torch.ones(2, 3, dtype=torch.float64, requires_grad=True))
    assert meta == ((2, 3), torch.float64, torch.device("cpu"), True)
