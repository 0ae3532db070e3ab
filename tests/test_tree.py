import torch

from fedmtl import tree as T


def test_weighted_mean_ignores_zero_weight_rows_even_if_nan():
    x = {"w": torch.tensor([[1.0, 2.0], [float("nan"), float("inf")], [3.0, 6.0]])}
    out = T.weighted_mean(x, torch.tensor([1.0, 0.0, 3.0]))
    assert torch.allclose(out["w"], torch.tensor([2.5, 5.0]))


def test_put_take_roundtrip_does_not_mutate():
    a = {"w": torch.zeros(4, 2)}
    b = T.put(a, torch.tensor([1, 3]), {"w": torch.ones(2, 2)})
    assert a["w"].sum() == 0
    assert torch.equal(T.take(b, torch.tensor([1, 3]))["w"], torch.ones(2, 2))


def test_all_finite_rows():
    x = {"a": torch.tensor([[1.0], [float("nan")]]), "b": torch.tensor([[float("inf")], [0.0]])}
    assert T.all_finite_rows(x).tolist() == [False, False]
    assert T.all_finite_rows({"a": torch.ones(3, 2)}).all()
