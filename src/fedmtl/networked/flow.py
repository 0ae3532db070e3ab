"""Connectivity of a clustered empirical graph measured by flows: how much flow every boundary edge can push into
its cluster and on to the cluster's labelled nodes.

Jung et al.'s recovery condition for total variation minimization over a partially labelled graph (the network
nullspace property; "Clustering in partially labeled stochastic block models via total variation minimization",
Jung 2019, and the networked-FL slides' "measure connectivity by flows") asks for a flow h on the edges with
h_e = rho A_e on every boundary edge (between clusters), |h_e| <= A_e on every edge inside a cluster, and flow
conservation at every unlabelled node: labelled nodes are the only sources and sinks.  The larger the rho that
can be routed, the better the labelled nodes are connected to the boundary, relative to the boundary's weight;
the condition the papers prove recovery under is rho >= 2.

``boundary_flow`` computes the largest such rho for each cluster exactly, as a linear program (SciPy's HiGHS):
the clusters decouple once the boundary edges' flows are fixed, the boundary flow entering cluster C at node u is
rho b_u (b_u: the weight of u's boundary edges), and it must leave u through C's own edges and reach C's labelled
nodes.  The graph's rho is the smallest over its clusters.
"""

from __future__ import annotations

import numpy as np

from ..graph import Graph, GraphError


def boundary_flow(graph: Graph, clusters: np.ndarray, labelled: np.ndarray) -> np.ndarray:
    """(C,) for each cluster c, the largest rho such that rho A_e on each of c's boundary edges can be routed inside c
    (capacities A_e) to c's labelled nodes.  ``clusters`` (N,) ints; ``labelled`` (N,) bool or node ids.  A cluster
    with no boundary edge has rho = inf; one with boundary edges but no labelled node reachable, 0."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    clusters = np.asarray(clusters, dtype=np.int64)
    if clusters.shape != (graph.num_nodes,):
        raise GraphError(f"clusters must give one cluster per node: shape {clusters.shape}, {graph.num_nodes} nodes")
    given = np.asarray(labelled)
    if given.dtype == bool:
        if given.shape != (graph.num_nodes,):
            raise GraphError(f"labelled: a mask of shape {given.shape} for {graph.num_nodes} nodes")
        lab = given
    else:
        lab = np.zeros(graph.num_nodes, dtype=bool)
        lab[given.astype(np.int64)] = True
    e, a = graph.edges, graph.weights
    ci, cj = clusters[e[:, 0]], clusters[e[:, 1]]
    boundary = ci != cj
    b = np.zeros(graph.num_nodes)  # boundary weight at each node
    np.add.at(b, e[boundary, 0], a[boundary])
    np.add.at(b, e[boundary, 1], a[boundary])
    out = np.zeros(int(clusters.max()) + 1)
    for c in range(len(out)):
        nodes = np.flatnonzero(clusters == c)
        bc = b[nodes]
        if bc.sum() == 0:
            out[c] = np.inf
            continue
        inner = np.flatnonzero(~boundary & (ci == c))
        free = nodes[~lab[nodes]]  # conservation holds here
        if not lab[nodes].any():
            out[c] = 0.0
            continue
        row_of = -np.ones(graph.num_nodes, dtype=np.int64)
        row_of[free] = np.arange(len(free))
        # variables: h_e for the inner edges (flow from e[0] to e[1], in [-A_e, A_e]), then rho >= 0
        # conservation at free u: sum_{e=(u,.)} h_e - sum_{e=(.,u)} h_e - rho b_u = 0 (what enters over the
        # boundary leaves through the cluster's edges)
        src, dst = e[inner, 0], e[inner, 1]
        rows, cols, vals = [], [], []
        for end, sign in ((src, 1.0), (dst, -1.0)):
            keep = row_of[end] >= 0
            rows.append(row_of[end[keep]])
            cols.append(np.flatnonzero(keep))
            vals.append(np.full(int(keep.sum()), sign))
        rows.append(np.arange(len(free)))
        cols.append(np.full(len(free), len(inner)))
        vals.append(-b[free])
        A_eq = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                          shape=(len(free), len(inner) + 1)).tocsr()
        cost = np.zeros(len(inner) + 1)
        cost[-1] = -1.0  # maximize rho
        bounds = [(-w, w) for w in a[inner]] + [(0, None)]
        res = linprog(cost, A_eq=A_eq if len(free) else None, b_eq=np.zeros(len(free)) if len(free) else None,
                      bounds=bounds, method="highs")
        if res.status == 3:  # unbounded: the boundary nodes are all labelled
            out[c] = np.inf
        elif res.status != 0:
            raise GraphError(f"the flow LP of cluster {c} failed: {res.message}")
        else:
            out[c] = float(res.x[-1])
    return out
