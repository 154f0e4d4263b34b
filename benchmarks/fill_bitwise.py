"""Fill outputs of this tree against another commit's, bit for bit.

A refactor that claims "behaviour unchanged" is checked here: every case below runs once with this
tree's ridgefill_runtime and once with COMMIT's (a `git worktree` of it, run in a child process
with that tree first on sys.path and this tree's compiled extension copied in), on the same model
files, and every tensor they produce must be equal with torch.equal (NaNs included).

Cases: SmolLM2-135M (exact; ridgefill at split 15 with the shipped maps and exact rows from the
special, lexical and attention selectors; the same with value and key rescale), Gemma 3 270M
(ridgefill at split 9 with its shipped maps, when its packages are installed), and tiny random
checkpoints built here by transformers: both hybrids (Qwen3.5, Qwen3-Next MoE) and both Gemma 3
layouts, each under the identity fill with five fixed exact rows (no tokenizer, so no selector). Each case records the prompt scores
(log p of every scored prompt token, argmax, first scored row) and 8 greedy tokens with their
logprobs.

    python benchmarks/fill_bitwise.py --against eb6641e [--threads 2]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
NEW = 8


def cases(models_dir: Path) -> dict[str, tuple[str | None, dict]]:
    """name -> (model path or None for the embedded one, FillConfig keyword arguments)."""
    from ridgefill_runtime.fill.settings import shipped_maps

    smol_maps = str(shipped_maps(15))
    rows = {"selectors": ("special", "lexical", "attention")}
    out: dict[str, tuple[str | None, dict]] = {
        "smollm2/exact": (None, {}),
        "smollm2/ridgefill+rows": (None, dict(arm="ridgefill", split=15, tail=256, maps=smol_maps, rows=rows)),
        "smollm2/ridgefill+rescale": (
            None,
            dict(arm="ridgefill", split=15, tail=256, maps=smol_maps, value_rescale=True, key_rescale=True),
        ),
    }
    try:
        from ridgefill_runtime.loader.packaged import packaged_model_path

        gemma = str(packaged_model_path("gemma3-270m"))
        out["gemma3-270m/ridgefill+rows"] = (
            gemma,
            dict(arm="ridgefill", split=9, tail=128, maps=str(shipped_maps(9, "gemma3-270m")), rows=rows),
        )
    except Exception as e:  # noqa: BLE001 - a missing package is reported, not fatal
        print(f"fill_bitwise: gemma3-270m skipped ({e})", file=sys.stderr)
    for folder in sorted(models_dir.iterdir()):
        split = num_layers(folder) // 2
        out[f"tiny/{folder.name}/identity+rows"] = (
            str(folder),
            dict(arm="identity", split=split, tail=12, rows={"selectors": ("special",)}),
        )
    return out


def num_layers(folder: Path) -> int:
    config = json.loads((folder / "config.json").read_text())
    return config.get("text_config", config)["num_hidden_layers"]


def prompt_for(llm, path: str | None, n: int) -> list[int]:
    """A real text prompt for the real models, seeded random ids for the tiny ones."""
    if path is None or path.endswith(".gguf"):
        text = Path(torch.__file__).with_name("functional.py").read_text()
        return llm.tokenizer.encode(text)[:n]
    vocab = llm.engine.model.config.vocab_size
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(5)).tolist()


def run_case(path: str | None, fill: dict) -> dict[str, torch.Tensor]:
    from ridgefill_runtime.config import CacheConfig, EngineConfig, FillConfig, RowsConfig
    from ridgefill_runtime.llm import LLM
    from ridgefill_runtime.sequence import SamplingParams

    if "rows" in fill:
        fill = dict(fill, rows=RowsConfig(**fill["rows"]))
    config = EngineConfig(
        model=path, cache=CacheConfig(kv_cache_gib=0.25, prefix_caching="off"), fill=FillConfig(**fill)
    )
    llm = LLM(config)
    if llm.tokenizer is None:  # tiny checkpoints have no tokenizer, so no selector but "special": fixed rows
        llm.engine.scheduler.select = lambda seq: [0, 9, 10, 33, 57]
    # NOTE: Gemma's 262K-token vocabulary makes each scored row's logits 1 MB: a shorter prompt
    n = {None: 1200}.get(path, 600 if path and path.endswith(".gguf") else 90)
    ids = prompt_for(llm, path, n)
    scored = llm.score(ids)
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=1)
    seq = llm.engine.add_request(ids, params)
    while llm.engine.has_unfinished():
        llm.engine.step()
    return {
        "prompt_logprobs": torch.tensor(scored["target_logprobs"], dtype=torch.float32),
        "prompt_argmax": torch.tensor(scored["argmax"]),
        "first_scored": torch.tensor([scored["first_scored"]]),
        "tokens": torch.tensor(list(seq.output_ids)),
        "token_logprobs": torch.tensor([lp.logprob for lp in output_records(seq)], dtype=torch.float32),
    }


def output_records(seq) -> list:
    """The sequence's per-token logprob records in either layout (`seq.logprobs.output` since the
    fields were grouped, `seq.output_logprobs` before), since this file also runs in the older tree."""
    return seq.logprobs.output if hasattr(seq, "logprobs") else seq.output_logprobs


def dump(models_dir: Path, out: Path) -> None:
    import ridgefill_runtime

    results = {"__tree__": str(Path(ridgefill_runtime.__file__).resolve().parents[1])}
    for name, (path, fill) in cases(models_dir).items():
        results[name] = run_case(path, fill)
        print(f"fill_bitwise: {name} done", file=sys.stderr)
    torch.save(results, out)


def build_tiny(models_dir: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "models"))
    from tiny_models import HYBRID_CONFIGS, build_tiny, build_tiny_hybrid

    for name in sorted(HYBRID_CONFIGS):
        build_tiny_hybrid(name, models_dir / name)
    for name in ("gemma3_sliding", "gemma3_two_global"):
        build_tiny(name, models_dir / name)


def child(tree: Path, models_dir: Path, out: Path, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(tree / "benchmarks" / "fill_bitwise.py"), "--dump", str(out)]
    cmd += ["--models-dir", str(models_dir), "--threads", str(threads)]
    subprocess.run(cmd, cwd=tree, env=env, check=True)
    results = torch.load(out)
    assert Path(results.pop("__tree__")) == tree.resolve(), "the child imported another tree's ridgefill_runtime"
    return results


def worktree_at(commit: str, where: Path) -> Path:
    tree = where / "ref"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit], check=True)
    script = tree / "benchmarks" / "fill_bitwise.py"
    shutil.copy(__file__, script)  # the reference commit may predate this script
    for so in glob.glob(str(ROOT / "ridgefill_runtime" / "_C*.so")):
        shutil.copy(so, tree / "ridgefill_runtime")
    return tree


def compare(ours: dict, theirs: dict) -> int:
    bad = 0
    print("| case | tensors | equal | first scored | greedy tokens |\n|---|---|---|---|---|")
    for name in sorted(set(ours) | set(theirs)):
        a, b = ours.get(name), theirs.get(name)
        if a is None or b is None:
            print(f"| {name} | missing in {'this tree' if a is None else 'the reference'} | no | | |")
            bad += 1
            continue
        same = [k for k in a if k in b and a[k].shape == b[k].shape and torch.equal(a[k], b[k])]
        ok = len(same) == len(a) == len(b)
        bad += not ok
        print(
            f"| {name} | {len(a)} | {'yes' if ok else 'NO: ' + ', '.join(sorted(set(a) - set(same)))} "
            f"| {int(a['first_scored'])} | {a['tokens'].tolist()} |"
        )
    return bad


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", help="the commit to compare with (e.g. the one before a refactor)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dump", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--models-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.dump:
        dump(args.models_dir, args.dump)
        return
    if not args.against:
        p.error("--against COMMIT is required")
    with tempfile.TemporaryDirectory(prefix="fill-bitwise-") as tmp:
        where = Path(tmp)
        models_dir = where / "models"
        build_tiny(models_dir)
        tree = worktree_at(args.against, where)
        try:
            theirs = child(tree, models_dir, where / "theirs.pt", args.threads)
            ours = child(ROOT, models_dir, where / "ours.pt", args.threads)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    print(
        f"threads={args.threads} this tree: {head.stdout.strip()} (+ uncommitted changes, if any) against {args.against}"
    )
    bad = compare(ours, theirs)
    print("bitwise equal" if bad == 0 else f"{bad} case(s) differ")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
