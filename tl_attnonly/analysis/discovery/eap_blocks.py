"""The linear algebra of EAP scores for one block of edges: sources' changes through a reader.

An edge ``u -> v`` of :class:`~.graph.HeadGraph` is scored by what source ``u`` writes into the
residual stream (its change ``a`` through its writer ``U``) read by input ``v`` (its gradient
``g`` through its reader ``R``), through ``v``'s normalisation linearised at each row (``lin``:
``x_hat``, ``1 / sigma``, the weight, whether it centres). :func:`block_scores` computes one
block ``[u, v]`` either way (writer x reader products, or each row's written and read residual
vectors), chunked to a byte budget; :func:`read_directions` gives what each input reads back
into the residual stream, so that many sources are read by one product
(:func:`~.edge_scores.edge_attribution_scores`' narrow groups, :mod:`.circuit_neurons`).
"""

from __future__ import annotations

import torch


def block_scores(
    a: torch.Tensor,
    U: torch.Tensor,
    g: torch.Tensor,
    R: torch.Tensor,
    lin,
    budget: int,
    path: str | None = None,
) -> torch.Tensor:
    """``sum_B a[B,u] U[u] J[B]^T-read R[v] g[B,v]``: EAP scores of one block, ``[u, v]``.

    ``a [B, u, r]`` source changes, ``U [u, r, d]`` writers, ``g [B, v, s]`` read gradients, ``R
    [v, d, s]`` readers; ``lin`` the reader's normalisation linearised at each of the ``B`` rows.
    With ``J = (diag(w) C - (w*x_hat) x_hat^T / d) / sigma`` (``C`` centring for LayerNorm):
    ``score = sum_B [a U C diag(w) R g - (a U . x_hat)((w*x_hat) . R g) / d] / sigma``.

    The first term is computed either through the ``[u, v, r, s]`` products of writers and readers
    (``path="pairs"``: cheap when ``r``, ``s`` are small and ``B`` large) or through each row's
    written and read residual vectors (``"rows"``: cheap for wide nodes such as MLP remainders or
    few rows); by default the cheaper one that fits ``budget``.
    """
    n_u, r, d = U.shape
    n_v, _, s = R.shape
    dtype = torch.promote_types(a.dtype, torch.float32)
    a, U, g, R = (t.to(dtype) for t in (a, U, g, R))
    if lin is None:
        Uw, inv = U, None
    else:
        x_hat, inv, w, centred = lin
        x_hat, inv = x_hat.to(dtype), inv.to(dtype)
        Uw = U - U.mean(-1, keepdim=True) if centred else U
        if w is not None:
            Uw = Uw * w.to(dtype)
    out = a.new_zeros(n_u, n_v)
    B, size = a.shape[0], a.element_size()
    if path is None:
        pairs_cost = n_u * n_v * r * s * (d + B)
        rows_cost = B * (n_v * s * d + n_u * r * d + n_u * n_v * d)
        fits = B * n_v * d * size <= budget
        path = "rows" if fits and rows_cost < pairs_cost else "pairs"
    if path == "rows":
        G = torch.einsum("vds,bvs->bvd", R, g)  # what each row's gradient reads, [B, v, d]
        per_u = max(1, B * (d + n_v) * size)
    else:
        per_u = max(1, n_v * r * s * 2 * size)
    step = max(1, min(n_u, budget // per_u))
    for start in range(0, n_u, step):
        sl = slice(start, start + step)
        aw = a[:, sl] if inv is None else a[:, sl] * inv[:, None, None]
        if path == "rows":
            A = torch.einsum("bur,urd->bud", aw, Uw[sl])  # what each row writes, [B, u, d]
            out[sl] = torch.einsum("bud,bvd->uv", A, G)
            continue
        M = torch.einsum("urd,vds->uvrs", Uw[sl], R)
        S = torch.einsum("bur,bvs->uvrs", aw, g)
        out[sl] = (M * S).sum((2, 3))
    if lin is not None:
        x_hat, inv, w, _ = lin
        x_hat, inv = x_hat.to(dtype), inv.to(dtype)
        alpha = (a * torch.einsum("urd,bd->bur", U, x_hat)).sum(-1)  # [B, u]
        wx = x_hat * w.to(dtype) if w is not None else x_hat
        beta = (g * torch.einsum("vds,bd->bvs", R, wx)).sum(-1)  # [B, v]
        out -= torch.einsum("bu,bv->uv", alpha * inv[:, None], beta) / d
    return out


def _read(g: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """``[B, v, d]``: the residual direction each of ``v`` inputs' gradient reads
    (``R [v, d, s] g [B, v, s]``)."""
    dtype = torch.promote_types(g.dtype, torch.float32)
    return torch.einsum("vds,bvs->bvd", R.to(dtype), g.to(dtype))


def _block_scores_from_rows(W: torch.Tensor, G: torch.Tensor, lin) -> torch.Tensor:
    """:func:`block_scores` from each row's written ``W [B, u, d]``
    (:func:`~.edge_scores._written`, transposed) and read ``G [B, v, d]`` (:func:`_read`) residual
    vectors: the same sum, computed once per source group and per input group instead of once
    per block (wide nodes such as MLP layers, r or s ~ d_mlp).
    """
    if lin is None:
        return torch.einsum("bud,bvd->uv", W, G)
    x_hat, inv, w, centred = lin
    x_hat, inv = x_hat.to(W.dtype), inv.to(W.dtype)
    d = W.shape[-1]
    Wc = W - W.mean(-1, keepdim=True) if centred else W
    if w is not None:
        Wc = Wc * w.to(W.dtype)
    out = torch.einsum("bud,bvd->uv", Wc * inv[:, None, None], G)
    alpha = torch.einsum("bud,bd->bu", W, x_hat)
    wx = x_hat * w.to(W.dtype) if w is not None else x_hat
    beta = torch.einsum("bvd,bd->bv", G, wx)
    return out - torch.einsum("bu,bv->uv", alpha * inv[:, None], beta) / d


def _read_direction(G: torch.Tensor, lin) -> torch.Tensor:
    """``H [B, v, d]``: the residual direction each of ``v`` inputs reads through its
    normalisation linearised at each row, so that :func:`_block_scores_from_rows` is
    ``einsum("bud,bvd->uv", W, H)``: every source ``W [B, u, d]`` (many groups concatenated) is
    read by one product, without a copy (``sum_d centre(W)_d w_d G_d = sum_d W_d centre(w G)_d``,
    centring is symmetric), and ``H`` is linear in ``G``, so the directions of several
    interpolation steps can be summed before the sources read them."""
    if lin is None:
        return G
    x_hat, inv, w, centred = lin
    x_hat, inv = x_hat.to(G.dtype), inv.to(G.dtype)
    d = G.shape[-1]
    Gw = G * w.to(G.dtype) if w is not None else G
    if centred:
        Gw = Gw - Gw.mean(-1, keepdim=True)
    wx = x_hat * w.to(G.dtype) if w is not None else x_hat
    beta = torch.einsum("bvd,bd->bv", G, wx)
    return Gw * inv[:, None, None] - x_hat[:, None, :] * (inv[:, None] * beta)[:, :, None] / d


def read_directions(g: torch.Tensor, R: torch.Tensor, lin) -> torch.Tensor:
    """``H [B, v, d]``: the residual direction each of ``v`` inputs reads, its gradient ``g [B, v,
    s]`` read back through its reader ``R [v, d, s]`` and its normalisation ``lin`` linearised at
    each of the ``B`` rows: a source writing ``W [B, u, d]`` into the residual stream has the EAP
    score ``einsum("bud,bvd->uv", W, H)`` on these inputs."""
    return _read_direction(_read(g, R), lin)


__all__ = ["block_scores", "read_directions"]
