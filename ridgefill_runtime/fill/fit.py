"""Closed-form ridge maps (seed 000, §2.2): running sums over documents, then one fp64 solve
per late layer. A_l = Y_lᵀX (XᵀX + αI)⁻¹ on centred rows, b_l = μ_l − A_l μ_S,
α = λ·tr(XᵀX)/d_in."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


class RidgeSums:
    """Sufficient statistics for one split: row count, Σx, Σy_l, ΣxxᵀA and Σxy_lᵀ (fp64).

    NOTE: products are formed in the rows' own dtype (fp32 activations give fp32 products)
    in blocks of rows, and summed in fp64, so memory is constant in the corpus size.
    """

    BLOCK = 1024

    def __init__(self, d: int, split: int, late_layers: list[int]):
        self.d, self.split, self.late = d, split, list(late_layers)
        self.n = 0
        self.sx = torch.zeros(d, dtype=torch.float64)
        self.sxx = torch.zeros(d, d, dtype=torch.float64)
        self.sy = {l: torch.zeros(d, dtype=torch.float64) for l in self.late}
        self.sxy = {l: torch.zeros(d, d, dtype=torch.float64) for l in self.late}
        self._x: torch.Tensor | None = None

    def add_split_rows(self, x: torch.Tensor) -> None:
        """x_S of one document's kept rows [n, d]; the late layers' rows follow via add_layer_rows."""
        self._x = x
        self.n += x.shape[0]
        self.sx += x.double().sum(0)
        self.sxx += _blocked_gram(x, x, self.BLOCK)

    def add_layer_rows(self, layer: int, y: torch.Tensor) -> None:
        """x_layer of the same rows [n, d]."""
        self.sy[layer] += y.double().sum(0)
        self.sxy[layer] += _blocked_gram(self._x, y, self.BLOCK)

    def merge(self, other: RidgeSums) -> None:
        self.n += other.n
        self.sx += other.sx
        self.sxx += other.sxx
        for l in self.late:
            self.sy[l] += other.sy[l]
            self.sxy[l] += other.sxy[l]

    # -- persistence: a new λ needs only new solves from the saved sums -------------------

    def save(self, path: Path) -> None:
        t = {"n": torch.tensor([self.n], dtype=torch.float64), "sx": self.sx, "sxx": self.sxx}
        for l in self.late:
            t[f"sy.{l}"], t[f"sxy.{l}"] = self.sy[l], self.sxy[l]
        save_file(t, str(path), metadata={"split": str(self.split), "d": str(self.d)})

    @classmethod
    def load(cls, path: Path, split: int, late_layers: list[int]) -> RidgeSums:
        t = load_file(str(path))
        s = cls(t["sx"].shape[0], split, late_layers)
        s.n, s.sx, s.sxx = int(t["n"][0]), t["sx"], t["sxx"]
        s.sy = {l: t[f"sy.{l}"] for l in late_layers}
        s.sxy = {l: t[f"sxy.{l}"] for l in late_layers}
        return s

    # -- the solve ----------------------------------------------------------------------

    def centred_gram(self) -> torch.Tensor:
        mu = self.sx / self.n
        return self.sxx - self.n * torch.outer(mu, mu)  # XᵀX of centred rows [d, d]

    def solve(self, lam: float) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """λ -> {layer: (A [d, d], b [d])} in fp64."""
        mu_x = self.sx / self.n
        xtx = self.centred_gram()
        alpha = lam * torch.trace(xtx) / self.d
        lhs = xtx + alpha * torch.eye(self.d, dtype=torch.float64)
        chol = torch.linalg.cholesky(lhs)
        out = {}
        for l in self.late:
            mu_y = self.sy[l] / self.n
            xty = self.sxy[l] - self.n * torch.outer(mu_x, mu_y)  # XᵀY_l of centred rows [d, d]
            a = torch.cholesky_solve(xty, chol).T  # (XᵀX + αI)⁻¹ XᵀY, transposed -> A [d_out, d_in]
            out[l] = (a, mu_y - a @ mu_x)
        return out


def _blocked_gram(x: torch.Tensor, y: torch.Tensor, block: int) -> torch.Tensor:
    """Σ_t x_t y_tᵀ [d, d] in fp64, from products of `block`-row slices in the rows' dtype."""
    acc = torch.zeros(x.shape[1], y.shape[1], dtype=torch.float64)
    for i in range(0, x.shape[0], block):
        acc += (x[i : i + block].T @ y[i : i + block]).double()
    return acc
