import torch

from fedmtl import tree as T


def test_weighted_mean_ignores_zero_weight_rows_even_if_nan():
    x = {"w": torch.tensor([[1.0, 2.0], [float("nan"), float("inf")], [3.0, 6.0]])}
    out = T.weighted_mean(x, torch.tensor([1.0, 0.0, 3.0]))
    assert torch.allclose(out["w"], torch.tensor([2.5, 5.0]))


def test_named_round_trip_checks_names_shapes_dtypes():
    from typing import NamedTuple

    import pytest

    class S(NamedTuple):
        pi: torch.Tensor
        params: dict

    tree = S(torch.rand(3), {"fc.weight": torch.randn(2, 4), "fc.bias": torch.zeros(2, dtype=torch.float64)})
    named = T.to_named(tree)
    assert set(named) == {".pi", ".params['fc.weight']", ".params['fc.bias']"}
    back = T.from_named(named, T.zeros_like(tree))
    assert isinstance(back, S) and all(torch.equal(a, b) for a, b in zip(T.leaves(back), T.leaves(tree), strict=True))
    with pytest.raises(T.TreeError, match="missing"):
        T.from_named({".pi": tree.pi}, tree)
    with pytest.raises(T.TreeError, match=r"fc.bias.*float32"):
        T.from_named({**named, ".params['fc.bias']": torch.zeros(2)}, tree)
    with pytest.raises(T.TreeError, match="shape|\\(3,\\)"):
        T.from_named({**named, ".pi": torch.zeros(4)}, tree)


def test_all_finite_rows():
    x = {"a": torch.tensor([[1.0], [float("nan")]]), "b": torch.tensor([[float("inf")], [0.0]])}
    assert T.all_finite_rows(x).tolist() == [False, False]
    assert T.all_finite_rows({"a": torch.ones(3, 2)}).all()
