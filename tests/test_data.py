import pytest
import torch

from fedmtl.data.federated import ClientGroup, DataError, FederatedData, Split, epoch_orders, padded, round_batches


def _split(sizes, d=3, classes=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, d, generator=g) for n in sizes]
    ys = [torch.randint(0, classes, (n,), generator=g) for n in sizes]
    return Split.from_lists(xs, ys)


def test_valid_data_builds():
    d = FederatedData(ClientGroup(_split([5, 7]), _split([2, 3])), num_classes=2)
    assert d.num_clients == 2 and d.feature_shape == (3,)


def test_label_out_of_range_is_a_clear_error():
    tr = _split([5, 7], classes=3)
    with pytest.raises(DataError, match=r"labels must lie in \[0, 1\], found values in \[0, 2\]"):
        FederatedData(ClientGroup(tr, _split([2, 3])), num_classes=2)


def test_empty_training_client_is_an_error():
    with pytest.raises(DataError, match=r"clients \[1\] have no examples"):
        FederatedData(ClientGroup(_split([5, 0, 3]), _split([2, 3, 1])), num_classes=2)


def test_shape_mismatch_and_nan_are_errors():
    tr = _split([5, 7])
    bad = Split(tr.x[:-1], tr.y, tr.offsets)
    with pytest.raises(DataError, match="11 examples but 12 labels"):
        FederatedData(ClientGroup(bad, _split([2, 3])), num_classes=2)
    with pytest.raises(DataError, match=r"feature shape \(4,\) != \(3,\)"):
        FederatedData(ClientGroup(tr, _split([2, 3], d=4)), num_classes=2)
    nan = Split(tr.x.clone(), tr.y, tr.offsets)
    nan.x[3, 1] = float("nan")
    with pytest.raises(DataError, match="NaN"):
        FederatedData(ClientGroup(nan, _split([2, 3])), num_classes=2)
    with pytest.raises(DataError, match="clients"):
        FederatedData(ClientGroup(tr, _split([2, 3, 4])), num_classes=2)


def test_round_batches_cover_each_client_once_per_epoch():
    sp = _split([5, 13, 1, 9], d=2)
    clients = torch.tensor([3, 0, 1])
    orders = epoch_orders(sp.counts[clients], 2, torch.Generator().manual_seed(1))
    b = round_batches(sp, clients, orders, torch.arange(3), batch_size=4)
    s0 = 4  # ceil(13 / 4)
    assert b.x.shape == (3, 2 * s0, 4, 2)
    for i, c in enumerate(clients.tolist()):
        xc, _ = sp.client(c)
        for e in range(2):
            m = b.mask[i, e * s0 : (e + 1) * s0].reshape(-1).bool()
            xe = b.x[i, e * s0 : (e + 1) * s0].reshape(-1, 2)[m]
            assert xe.shape[0] == xc.shape[0]
            # the epoch is a permutation of the client's examples
            assert torch.equal(torch.sort(xe[:, 0]).values, torch.sort(xc[:, 0]).values)
            # pos points at the same example in the first epoch's order
            first = b.x[i, :s0].reshape(-1, 2)
            pos = b.pos[i, e * s0 : (e + 1) * s0].reshape(-1)[m]
            assert torch.equal(first[pos], xe)


def test_batches_do_not_depend_on_grouping():
    sp = _split([5, 13, 1, 9], d=2)
    clients = torch.arange(4)
    orders = epoch_orders(sp.counts, 1, torch.Generator().manual_seed(3))
    together = round_batches(sp, clients, orders, torch.arange(4), batch_size=4)
    alone = round_batches(sp, clients, orders, torch.tensor([2]), batch_size=4)
    assert torch.equal(together.x[2, 0, :1], alone.x[0, 0, :1])  # client 2's one example, first slot
    assert alone.x.shape[2] == 1  # a batch larger than the client's data pads only to its size


def test_padded_views():
    sp = _split([2, 4])
    x, y, m = padded(sp, torch.tensor([1, 0]))
    assert x.shape == (2, 4, 3) and m.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert torch.equal(x[1, :2], sp.client(0)[0])


def test_padded_clients_of_one_size_stored_in_order_are_a_view_of_the_split():
    sp = _split([3, 3, 3, 2])
    x, y, m = padded(sp, torch.tensor([1, 2]))  # consecutive, one size: the split's own memory
    assert x.data_ptr() == sp.x[3:].data_ptr() and bool((m == 1).all())
    for ids in ([1, 2], [2, 1], [0, 2], [0, 1, 2], [3, 0]):  # the view and the gathers agree
        x, y, m = padded(sp, torch.tensor(ids))
        for i, k in enumerate(ids):
            n = int(sp.counts[k])
            assert torch.equal(x[i, :n], sp.client(k)[0]) and torch.equal(y[i, :n], sp.client(k)[1])
            assert m[i].sum() == n


def test_ragged_batches_equal_padded_ones_without_padding():
    from fedmtl.data.federated import ragged_batches

    sp = _split([70, 33, 8], d=2)
    clients = torch.arange(3)
    orders = epoch_orders(sp.counts, 3, torch.Generator().manual_seed(5))
    for i, n in enumerate([70, 33, 8]):
        pad = round_batches(sp, clients, orders, torch.tensor([i]), batch_size=16)
        rag = ragged_batches(sp, clients, orders, i, 16)
        assert sum(len(x) for x in rag.x) == 3 * n
        for s in range(len(rag.x)):
            k = len(rag.x[s])
            assert torch.equal(rag.x[s], pad.x[0, s, :k]) and torch.equal(rag.pos[s], pad.pos[0, s, :k])
            assert int(pad.mask[0, s].sum()) == k
        assert int(torch.cat(rag.pos).max()) < n  # positions index the client's real examples only


def test_drop_last_leaves_out_each_epochs_partial_batch_on_both_runners():
    """run.drop_last: a client trains on its full batches only (as DataLoader(drop_last=True)); a client with fewer
    examples than a batch trains on none; vmap and loop agree; the default keeps every example."""
    import numpy as np

    import fedmtl
    from fedmtl.data.federated import epoch_orders, ragged_batches, round_batches

    rng = np.random.default_rng(0)
    pairs = [(rng.normal(size=(n, 3)).astype(np.float32), rng.integers(0, 2, n)) for n in (25, 7, 40)]
    data = fedmtl.FederatedData.from_arrays(pairs, pairs, num_classes=2)
    tr = data.seen.train
    orders = epoch_orders(tr.counts, 1, torch.Generator().manual_seed(0))
    b = round_batches(tr, torch.arange(3), orders, torch.arange(3), 10, drop_last=True)
    assert b.mask.sum(-1).tolist() == [[10, 10, 0, 0], [0] * 4, [10] * 4]
    assert b.n.tolist() == [25, 7, 40]
    full = round_batches(tr, torch.arange(3), orders, torch.arange(3), 10)
    assert full.mask.sum().item() == 25 + 7 + 40
    r = ragged_batches(tr, torch.arange(3), orders, 0, 10, drop_last=True)
    assert [len(x) for x in r.x] == [10, 10]
    assert torch.equal(r.idx[1], b.idx[0, 1])  # the same examples kept
    tiny = ragged_batches(tr, torch.arange(3), orders, 1, 10, drop_last=True)
    assert int(tiny.limit) == 0  # one step, never live
    cfg = {"model": {"name": "linear"}, "algorithm": {"name": "fedavg"},
           "run": {"rounds": 2, "batch_size": 10, "drop_last": True}}
    a = fedmtl.run({**cfg, "run": {**cfg["run"], "runner": "vmap"}}, data=data)
    c = fedmtl.run({**cfg, "run": {**cfg["run"], "runner": "loop"}}, data=data)
    for k in a.server.params:
        assert torch.allclose(a.server.params[k], c.server.params[k], atol=1e-6)
    d = fedmtl.run({**cfg, "run": {**cfg["run"], "drop_last": False}}, data=data)
    assert not torch.allclose(a.server.params["weight"], d.server.params["weight"])
    assert "drop_last" not in d.summary["config"]["run"]  # the default is not recorded: older run dirs still match
    with pytest.raises(ValueError, match="local_epochs = 1"):
        fedmtl.run({**cfg, "run": {**cfg["run"], "local_epochs": 2}}, data=data)


@pytest.mark.parametrize("runner", ["vmap", "loop", "stacked"])
def test_drop_last_with_fedreps_head_epoch(runner):
    """FedRep's head epochs come before the body epoch, so its batches hold two epochs under run.drop_last; an
    example the first epoch dropped has a number above the first epoch's width (this used to fail with an index
    error).  Every runner trains and agrees."""
    import numpy as np

    import fedmtl

    rng = np.random.default_rng(1)
    pairs = [(rng.normal(size=(n, 6)).astype(np.float32), rng.integers(0, 3, n)) for n in (25, 7, 43)]
    data = fedmtl.FederatedData.from_arrays(pairs, pairs, num_classes=3)
    cfg = {"model": {"name": "mlp", "hidden": [8]}, "algorithm": {"name": "fedrep", "head_epochs": 1},
           "run": {"rounds": 2, "batch_size": 10, "drop_last": True, "runner": runner}}
    res = fedmtl.run(cfg, data=data, seeds=[1, 2])
    ref = fedmtl.run({**cfg, "run": {**cfg["run"], "runner": "loop"}}, data=data, seeds=[1, 2])
    from fedmtl.algorithms import FedRep

    # FedRep has no clients form: asked for the stacked runner it trains on vmap (recorded in the summary)
    took = runner if runner != "stacked" or FedRep.clients_form() else "vmap"
    assert [r.summary["path"]["executor"] for r in (*res.runs, *ref.runs)] == [took, took, "loop", "loop"]
    for a, b in zip(res.runs, ref.runs, strict=True):
        for k in a.server.params:
            assert torch.allclose(a.server.params[k], b.server.params[k], atol=1e-5)


def test_fedem_mixture_weights_sum_to_one_under_drop_last():
    """pi is the mean responsibility over the examples a client trained on: under run.drop_last (the tail of the epoch
    left out; a client smaller than a batch keeps nothing and keeps its pi) every client's pi still sums to 1, on
    every executor."""
    import numpy as np

    import fedmtl

    rng = np.random.default_rng(2)
    pairs = [(rng.normal(size=(n, 5)).astype(np.float32), rng.integers(0, 3, n)) for n in (25, 7, 43, 18)]
    data = fedmtl.FederatedData.from_arrays(pairs, pairs, num_classes=3)
    for runner in ("vmap", "loop", "stacked"):
        cfg = {"model": {"name": "linear"}, "algorithm": {"name": "fedem", "num_components": 3},
               "run": {"rounds": 2, "batch_size": 10, "drop_last": True, "runner": runner}}
        res = fedmtl.run(cfg, data=data)
        pi = res.client_states().pi
        assert torch.allclose(pi.sum(-1), torch.ones(4, dtype=pi.dtype), atol=1e-5), (runner, pi.sum(-1))
        assert torch.allclose(pi[1], torch.full((3,), 1 / 3, dtype=pi.dtype))  # 7 examples < a batch: the initial pi
