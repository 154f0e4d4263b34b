"""`ridgefill fit`: one capture pass for several splits, resumable; λ chosen on held-out text."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..cache.spec import spec_of
from .capture import run_layer_inputs
from .fit import RidgeSums
from .maps import MapMeta, save_maps

LAMBDA_GRID = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)


@dataclass(frozen=True)
class Document:
    name: str
    ids: tuple[int, ...]

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(list(self.ids)).encode()).hexdigest()[:16]


def kept_rows(ids, special_ids: frozenset[int]) -> torch.Tensor:
    """Rows that enter the sums. NOTE: the first position (the attention sink, with a huge
    activation) and special tokens are always exact, so they stay out of the fit: they
    would dominate tr(XᵀX) and mis-scale the penalty."""
    keep = torch.tensor([t not in special_ids for t in ids])
    keep[0] = False
    return keep.nonzero().flatten()


def capture_document(model, doc: Document, sums: dict[int, RidgeSums], special_ids) -> int:
    rows = kept_rows(doc.ids, special_ids)
    splits = sorted(sums)

    def consume(layer: int, h: torch.Tensor) -> None:
        x = h[rows].float().cpu()
        for s in splits:
            if layer == s:
                sums[s].add_split_rows(x)
            elif layer > s:
                sums[s].add_layer_rows(layer, x)

    run_layer_inputs(model, list(doc.ids), consume)
    return len(rows)


class FitState:
    """The out dir: sums per split plus progress.json, rewritten after every document so an
    interrupted fit resumes where it stopped."""

    def __init__(self, out: Path, d: int, splits: list[int], num_layers: int):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.progress_path = out / "progress.json"
        self.late = {s: list(range(s, num_layers)) for s in splits}
        prog = json.loads(self.progress_path.read_text()) if self.progress_path.exists() else {}
        if prog and prog.get("splits") != splits:
            raise ValueError(f"{out}: holds a fit for splits {prog.get('splits')}, not {splits}; use another --out")
        self.done: list[str] = prog.get("done", [])
        self.sums = {
            s: (RidgeSums.load(self._sums_path(s), s, self.late[s]) if self.done else RidgeSums(d, s, self.late[s]))
            for s in splits
        }
        self.splits = splits

    def _sums_path(self, split: int) -> Path:
        return self.out / f"sums-split{split}.safetensors"

    def commit(self, digest: str) -> None:
        for s, sums in self.sums.items():
            tmp = self._sums_path(s).with_suffix(".tmp")
            sums.save(tmp)
            tmp.replace(self._sums_path(s))
        self.done.append(digest)
        tmp = self.progress_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"splits": self.splits, "done": self.done}))
        tmp.replace(self.progress_path)


@torch.inference_mode()
def heldout_score(model, sums: RidgeSums, lam: float, heldout: list[tuple[torch.Tensor, dict]]) -> float:
    """Mean cosine between the K/V a late attention layer writes from x̂ and from the true input
    (a recurrent layer writes no K/V: there, between x̂ and the true input itself)."""
    maps = sums.solve(lam)
    attends = set(spec_of(model).attention_layers)
    total, count = 0.0, 0
    for positions, xs in heldout:
        rope = model.rope(positions)
        x_split = xs[sums.split]
        for layer, (a, b) in maps.items():
            x_hat = (x_split.double() @ a.T + b).to(model.dtype)
            if layer not in attends:
                total += float(torch.nn.functional.cosine_similarity(x_hat.float(), xs[layer].float(), dim=-1).mean())
                count += 1
                continue
            k_hat, v_hat = model.kv_only(layer, x_hat, rope)
            k, v = model.kv_only(layer, xs[layer], rope)
            cos_k = torch.nn.functional.cosine_similarity(k_hat.flatten(1), k.flatten(1), dim=-1)
            cos_v = torch.nn.functional.cosine_similarity(v_hat.flatten(1), v.flatten(1), dim=-1)
            total += float((cos_k.mean() + cos_v.mean()) / 2)
            count += 1
    return total / count


def capture_heldout(model, docs: list[Document], special_ids, rows_per_doc: int = 512):
    """Evenly spaced kept rows of each held-out document: (positions [r], {layer: x [r, d]})."""
    out = []
    for doc in docs:
        kept = kept_rows(doc.ids, special_ids)
        pick = kept[torch.linspace(0, len(kept) - 1, min(rows_per_doc, len(kept))).long()]
        xs: dict[int, torch.Tensor] = {}
        run_layer_inputs(model, list(doc.ids), lambda layer, h: xs.__setitem__(layer, h[pick].clone()))
        out.append((pick.to(model.device), xs))
    return out


def fit_maps(
    model,
    model_identity: str,
    calib: list[Document],
    heldout: list[Document],
    splits: list[int],
    out: Path,
    special_ids: frozenset[int],
    grid=LAMBDA_GRID,
    log=print,
) -> dict:
    cfg = model.config
    state = FitState(out, cfg.hidden_size, sorted(splits), cfg.num_layers)
    todo = [d for d in calib if d.digest not in state.done]
    if len(todo) < len(calib):
        log(f"fit: resuming, {len(calib) - len(todo)} of {len(calib)} documents already summed")
    for doc in tqdm(todo, desc="capture", unit="doc"):
        capture_document(model, doc, state.sums, special_ids)
        state.commit(doc.digest)
    held = capture_heldout(model, heldout, special_ids)
    calib_hash = hashlib.sha256("".join(sorted(d.digest for d in calib)).encode()).hexdigest()[:16]
    report = {
        "calibration_documents": len(calib),
        "heldout_documents": len(heldout),
        "calibration_hash": calib_hash,
        "splits": {},
    }
    for s, sums in state.sums.items():
        scores = {lam: heldout_score(model, sums, lam, held) for lam in grid}
        best = max(scores, key=scores.get)
        meta = MapMeta(
            model_identity=model_identity,
            architecture=cfg.architecture,
            num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
            split=s,
            lam=best,
            calibration_rows=sums.n,
            calibration_hash=calib_hash,
        )
        path = out / f"maps-split{s}.safetensors"
        save_maps(path, meta, {l: (a.float(), b.float()) for l, (a, b) in sums.solve(best).items()})
        report["splits"][s] = {"lambda": best, "rows": sums.n, "heldout_cosine": scores, "maps": path.name}
        log(f"fit: split {s}: λ={best:g} held-out K/V cosine {scores[best]:.4f} ({sums.n} rows) -> {path}")
    (out / "fit-report.json").write_text(json.dumps(report, indent=1, default=str))
    return report
