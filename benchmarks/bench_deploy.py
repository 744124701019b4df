#!/usr/bin/env python
"""Deployment figures: this package's generate() against the CTranslate2 exports of the same model.

    hf-scratch-export-ct2 --model outputs/m --output_dir outputs/m-ct2
    hf-scratch-export-ct2 --model outputs/m --output_dir outputs/m-ct2-int8 --quantization int8
    python benchmarks/bench_deploy.py --model outputs/m --ct2 outputs/m-ct2 outputs/m-ct2-int8

On the test split of the shipped corpus (755 verse pairs): greedy decoding with the translate module's batching
(sorted by length, batches of 32, max 160 new tokens) timed once over the whole split, and one sentence per call
over the first --batch1_sentences sentences; new tokens/s counts every generated token including </s>; test BLEU
(sacreBLEU 13a) of the batch-32 output; the weights' size on disk; how many outputs are token-identical to
generate()'s. `--beam` adds one untimed beam-4 pass (early_stopping=True) per engine for the identity count.
Each engine runs in its own process (CTranslate2's OpenMP runtime slows PyTorch in a shared process), with
--threads threads. Prints a Markdown table and writes JSON to --json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, machine_info

TEST_FILE = ROOT / "hf_scratch_transformer" / "corpus" / "bible_en_es.test.jsonl.gz"


def test_split(source_lang="en", target_lang="es"):
    with gzip.open(TEST_FILE, "rt", encoding="utf-8") as handle:
        rows = [json.loads(line)["translation"] for line in handle]
    return [row[source_lang] for row in rows], [row[target_lang] for row in rows]


def core_run(backend, tokenizer, max_new_tokens: int):
    """run(texts, batch_size, num_beams) -> token ids per text, through the package's translation core, without
    the length bound (the engines are compared at the same max_new_tokens)."""
    from hf_scratch_transformer.translation_core import DecodingOptions, translate_batches

    def run(texts, batch_size, num_beams=1):
        options = DecodingOptions(num_beams=num_beams, batch_size=batch_size, max_new_tokens=max_new_tokens,
                                  max_len_a=0, max_len_b=0)
        return [found[0].token_ids if found else [] for found in translate_batches(backend, tokenizer, texts, options)]

    return run


def generate_engine(path: str, max_new_tokens: int):
    """This package's generate(): (run(texts, batch_size, num_beams), decode(ids), weights on disk, model)."""
    import transformers

    from hf_scratch_transformer.translation.translate import load_model_and_tokenizer
    from hf_scratch_transformer.translation_core import TorchBackend, decode_ids

    transformers.logging.set_verbosity_error()
    model, tokenizer = load_model_and_tokenizer(path, "cpu")
    size = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    run = core_run(TorchBackend(model), tokenizer, max_new_tokens)
    return run, lambda ids: decode_ids(tokenizer, ids), size, model


def ct2_engine(path: str, threads: int, max_new_tokens: int):
    """A CTranslate2 export: (run, decode, weights on disk, None)."""
    from hf_scratch_transformer.translation.ct2_backend import CT2Backend
    from hf_scratch_transformer.translation_core import decode_ids

    backend = CT2Backend(path, device="cpu", intra_threads=threads)
    run = core_run(backend, backend.tokenizer, max_new_tokens)
    return run, lambda ids: decode_ids(backend.tokenizer, ids), (Path(path) / "model.bin").stat().st_size, None


def worker(engine: str, path: str, threads: int, batch1_sentences: int, max_new_tokens: int, beam: bool) -> dict:
    """Runs in a fresh process; returns the measurements of one engine."""
    import sacrebleu
    import torch

    torch.set_num_threads(threads)
    sources, references = test_split()
    if engine == "generate":
        run, decode, size, model = generate_engine(path, max_new_tokens)
    else:
        run, decode, size, model = ct2_engine(path, threads, max_new_tokens)
    run(sources[:32], 32)  # warm-up
    start = time.perf_counter()
    ids = run(sources, 32)
    seconds_32 = time.perf_counter() - start
    start = time.perf_counter()
    ids_1 = [run([text], 1)[0] for text in sources[:batch1_sentences]]
    seconds_1 = time.perf_counter() - start
    hypotheses = [decode(x) for x in ids]
    result = {
        "engine": engine, "path": path, "size_bytes": size, "threads": threads, "machine": machine_info(threads),
        "batch32": {"seconds": seconds_32, "new_tokens": sum(map(len, ids)),
                    "tokens_per_s": sum(map(len, ids)) / seconds_32},
        "batch1": {"seconds": seconds_1, "sentences": batch1_sentences, "new_tokens": sum(map(len, ids_1)),
                   "tokens_per_s": sum(map(len, ids_1)) / seconds_1},
        "bleu": sacrebleu.corpus_bleu(hypotheses, [references]).score,
        "chrf": sacrebleu.corpus_chrf(hypotheses, [references]).score,
        "ids": ids, "ids_batch1": ids_1,
    }
    if beam:
        if model is not None:
            model.generation_config.early_stopping = True
        beam_ids = run(sources, 32, num_beams=4)
        result["beam4"] = {"ids": beam_ids,
                           "bleu": sacrebleu.corpus_bleu([decode(x) for x in beam_ids], [references]).score}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="save_pretrained directory (generate())")
    parser.add_argument("--ct2", nargs="*", default=[], help="directories written by hf-scratch-export-ct2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch1_sentences", type=int, default=100)
    parser.add_argument("--max_new_tokens", type=int, default=160)
    parser.add_argument("--beam", action="store_true", help="also a beam-4 pass for the identity count")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "deploy.json"))
    parser.add_argument("--_worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._worker:
        engine, path = args._worker
        result = worker(engine, path, args.threads, args.batch1_sentences, args.max_new_tokens, args.beam)
        print("DEPLOY_JSON " + json.dumps(result))
        return

    results = []
    for engine, path in [("generate", args.model)] + [("ct2", p) for p in args.ct2]:
        cmd = [sys.executable, __file__, "--_worker", engine, path, "--model", args.model, "--threads",
               str(args.threads), "--batch1_sentences", str(args.batch1_sentences), "--max_new_tokens",
               str(args.max_new_tokens)] + (["--beam"] if args.beam else [])
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
        run = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((l for l in run.stdout.splitlines() if l.startswith("DEPLOY_JSON ")), None)
        if line is None:
            raise SystemExit(f"{engine} {path} failed: {run.stderr.strip()[-2000:]}")
        results.append(json.loads(line[len("DEPLOY_JSON "):]))
        print(f"done: {engine} {path}", file=sys.stderr, flush=True)
    reference = results[0]
    print("| engine | size on disk | greedy, batch 1, new tokens/s | greedy, batch 32, new tokens/s | test BLEU "
          "(greedy) | outputs identical to generate() (greedy" + (" / beam 4)" if args.beam else ")") + " |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        same = sum(a == b for a, b in zip(r["ids"], reference["ids"]))
        cell = f"{same}/{len(r['ids'])}"
        if args.beam:
            same_beam = sum(a == b for a, b in zip(r["beam4"]["ids"], reference["beam4"]["ids"]))
            cell += f" / {same_beam}/{len(r['ids'])}"
        name = "generate()" if r["engine"] == "generate" else f"CTranslate2 {Path(r['path']).name}"
        print(f"| {name} | {r['size_bytes'] / 2**20:.1f} MiB | {r['batch1']['tokens_per_s']:,.0f} | "
              f"{r['batch32']['tokens_per_s']:,.0f} | {r['bleu']:.2f} | {cell} |")
    if args.beam:
        print("beam-4 BLEU: " + ", ".join(f"{r['engine']} {Path(r['path']).name} {r['beam4']['bleu']:.2f}"
                                          for r in results))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    for r in results:
        r.pop("ids"), r.pop("ids_batch1"), r.get("beam4", {}).pop("ids", None)
    Path(args.json).write_text(json.dumps({"results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
